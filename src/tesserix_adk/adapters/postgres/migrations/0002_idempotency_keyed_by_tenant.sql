-- Idempotency records are keyed by (tenant, key): two tenants using the same key (a
-- business key such as order-5) hold two records. The rows are kept as they are.
DO $$
DECLARE
    pkey name;
    keyed boolean;
BEGIN
    SELECT c.conname, c.conkey = ARRAY[
          (SELECT attnum FROM pg_attribute
            WHERE attrelid = 'adk_idempotency'::regclass AND attname = 'tenant'),
          (SELECT attnum FROM pg_attribute
            WHERE attrelid = 'adk_idempotency'::regclass AND attname = 'key')
      ]::int2[]
    INTO pkey, keyed
    FROM pg_constraint AS c
    WHERE c.conrelid = 'adk_idempotency'::regclass AND c.contype = 'p';
    IF keyed IS NOT TRUE THEN
        IF pkey IS NOT NULL THEN
            EXECUTE format('ALTER TABLE adk_idempotency DROP CONSTRAINT %I', pkey);
        END IF;
        ALTER TABLE adk_idempotency ADD PRIMARY KEY (tenant, key);
    END IF;
END
$$;
