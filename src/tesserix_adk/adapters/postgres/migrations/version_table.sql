CREATE TABLE IF NOT EXISTS adk_schema_version (
    id         integer PRIMARY KEY CHECK (id = 1),
    version    integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
