"""A durable turn on every backend and against its peers, on one conversation: ratios
measured in one run, never asserted.

    python benchmarks/turns.py [--quick | --smoke] [--only sqlite-full,postgres,...]

One turn is an assistant message with one tool call of ~500 characters of arguments and a
~500-character result (``conversation.py``). Ours runs it end to end through the real
``AgentRunner`` (``ours.py``) on memory, SQLite (``synchronous`` FULL, the default, and
NORMAL), PostgreSQL and Redis (a throwaway server with ``appendonly yes`` and
``appendfsync everysec`` or ``always``); beside it, on each backend, the raw floors (the
turn in 2 or 3 commits with the plain driver), LangGraph (``SqliteSaver``,
``PostgresSaver``) and DBOS steps (SQLite, PostgreSQL) (``peers.py``).

Printed, each as ratios measured here:

1. per turn: each of our turns (and LangGraph's, DBOS's) is interleaved with one turn of
   the 2-commit and one of the 3-commit floor on the same backend (on files or schemas of
   their own), so the disk and CPU noise of a shared machine hits both alike; three runs,
   the frameworks' order reversed every other run; median and spread (min-max) of the
   three ratios. LangGraph or DBOS against ours divides their ratios to their own floors;
2. counts per turn, from an untimed pass (``counting.py``): commits (writing
   transactions), transactions, statements, round trips, fsyncs, and bytes stored;
3. flatness: the last turns of a long run, each alternating with a turn of fresh runs in
   the same process and store, so turn ~1,000 is timed beside turns ~3-25;
4. bytes: the stored size of one run on SQLite, ours against the floor, LangGraph, DBOS;
5. resume: a run whose process died after 1,000 and 5,000 turns (``--quick``: 200 and
   1,000), resumed up to its next model call, against LangGraph's ``get_state`` on the
   same conversation; round trips per resume;
6. concurrency: durable turns per second of K = 1 / 8 / 32 runs at once in this process.

Plots go to ``benchmarks/results/`` (``--smoke`` writes none). The machine's other load
shows in every absolute figure; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import counting
import ours
import peers
import report
import servers

RESULTS = Path(__file__).resolve().parent / "results"

SQLITE = ("sqlite-full", "sqlite-normal")
REDIS = ("redis-everysec", "redis-always")
CONFIGS = ("memory", *SQLITE, "postgres", *REDIS)


@dataclass(frozen=True)
class Profile:
    name: str
    turns: int  # per timed run
    reps: int
    long: int  # the flatness run
    window: int  # turns counted
    bytes_turns: int  # the bytes run (and LangGraph's per-turn curve)
    resume: tuple[int, ...]
    resumes: int
    ks: tuple[int, ...]
    k_turns: int
    peers: bool
    configs: tuple[str, ...] = CONFIGS


PROFILES = {
    "smoke": Profile("smoke", 4, 1, 6, 2, 0, (4,), 1, (1, 2), 2, False, ("memory", "sqlite-full")),
    "quick": Profile("quick", 20, 3, 100, 10, 100, (100, 300), 3, (1, 8, 32), 5, True),
    "full": Profile("full", 60, 3, 1000, 30, 400, (1000, 5000), 3, (1, 8, 32), 10, True),
}
# A longer resume run is left out (and said so) when building it would take longer than this.
RESUME_BUDGET = {"smoke": 30.0, "quick": 45.0, "full": 100.0}

SKIP = 3  # the first turns of a run (connections, caches) are left out of its median


@dataclass
class Results:
    profile: str
    commit: str
    started: str
    machine: str
    notes: list[str] = field(default_factory=list)
    # config -> who -> per rep {"own", "floor2", "floor3"}: median seconds per turn, the
    # floors' turns interleaved with who's
    per_turn: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)
    bytes_per_turn: dict[str, dict[str, float]] = field(default_factory=dict)
    counts: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)
    flat: dict[str, list[float]] = field(default_factory=dict)  # config -> per-turn seconds
    # config -> [(turns so far, late turns' median, a fresh run's median right after)]
    flat_pairs: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    lg_curve: list[float] = field(default_factory=list)
    bytes_run: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    resume: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    resume_counts: dict[str, dict[str, float | None]] = field(default_factory=dict)
    throughput: dict[str, dict[str, float]] = field(default_factory=dict)


# --- where each measurement runs ---------------------------------------------------------


@dataclass
class Place:
    url: str
    size: Callable[[], int]
    path: str = ""  # SQLite
    synchronous: str = "full"


class Env:
    """The temporary directory, the throwaway Redis servers and the PostgreSQL corner."""

    def __init__(self, stack: contextlib.ExitStack, configs: tuple[str, ...]) -> None:
        self.stack = stack
        self.tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tesserix-turns-"))
        self.redis: dict[str, servers.RedisServer] = {}
        self.missing: dict[str, str] = {}
        self.serial = 0
        for config in configs:
            if config in REDIS:
                try:
                    self.redis[config] = stack.enter_context(
                        servers.redis_server(config.split("-")[1])
                    )
                except servers.Unreachable as exc:
                    self.missing[config] = str(exc)
            elif config == "postgres":
                why = servers.postgres_reachable()
                if why:
                    self.missing[config] = why

    @contextlib.contextmanager
    def place(self, config: str) -> Iterator[Place]:
        self.serial += 1
        if config == "memory":
            yield Place("memory://", lambda: 0)
        elif config in SQLITE:
            path = os.path.join(self.tmp, f"{config}-{self.serial}.sqlite3")
            sync = config.split("-")[1]
            query = "" if sync == "full" else "?synchronous=normal"  # FULL is the default
            try:
                yield Place(
                    f"sqlite:///{path}{query}",
                    lambda: peers.sqlite_stored_bytes(path),
                    path=path,
                    synchronous=sync,
                )
            finally:
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path + suffix)
        elif config == "postgres":
            with servers.postgres_schema() as (url, schema):
                yield Place(url, lambda: servers.postgres_schema_bytes(schema))
        elif config in REDIS:
            server = self.redis[config]
            prefix = f"b{self.serial}:"
            yield Place(f"{server.url}?prefix={prefix}", lambda: _aof_size(server))
        else:
            raise ValueError(config)

    def window(self, config: str) -> Callable[[], AbstractContextManager[Any]] | None:
        if config in SQLITE:
            return counting.sqlite_window
        if config == "postgres":
            return counting.postgres_window
        if config in REDIS:
            server = self.redis[config]
            return lambda: _redis_window(server)
        return None


def _aof_size(server: servers.RedisServer) -> int:
    import redis

    with redis.Redis(port=server.port) as client:
        return int(client.info("persistence")["aof_current_size"])


@contextlib.contextmanager
def _redis_window(server: servers.RedisServer) -> Iterator[counting.Counts]:
    import redis

    counts = counting.Counts()
    with redis.Redis(port=server.port) as client:
        before = counting.redis_commands(client.info("commandstats"))
        with counting.redis_round_trips() as trips, counting.fsyncs(server.pid) as synced:
            yield counts
        counts.statements = counting.redis_commands(client.info("commandstats")) - before
        counts.round_trips = trips[0]
        counts.fsyncs = synced[0]


# --- one measurement ---------------------------------------------------------------------


def who_for(config: str, profile: Profile) -> list[str]:
    if config == "memory":
        return ["ours"]
    names = ["floor2", "floor3", "ours"]
    if profile.peers and config not in REDIS:
        names.append("langgraph")
        if config != "sqlite-normal":  # DBOS sets its SQLite file up its own way
            names.append("dbos")
    return names


class Runner:
    def __init__(self, env: Env) -> None:
        self.env = env
        self.dbos: peers.Dbos | None = None
        self.dbos_size: Callable[[], int] = lambda: 0
        self.dbos_for = ""

    def launch_dbos(self, config: str) -> peers.Dbos:
        if self.dbos is not None and self.dbos_for == config:
            return self.dbos
        self.close_dbos()
        if config == "postgres":
            schema_cm = servers.postgres_schema()
            _, schema = self.env.stack.enter_context(schema_cm)
            self.dbos = peers.Dbos(servers.POSTGRES_URL, schema)
            self.dbos_size = lambda: servers.postgres_schema_bytes(schema)
        else:
            path = os.path.join(self.env.tmp, f"dbos-{self.env.serial}.sqlite3")
            self.env.serial += 1
            self.dbos = peers.Dbos(f"sqlite:///{path}")
            self.dbos_size = lambda: peers.sqlite_stored_bytes(path)
        self.dbos_for = config
        return self.dbos

    def close_dbos(self) -> None:
        if self.dbos is not None:
            self.dbos.close()
            self.dbos = None

    def measure(
        self,
        config: str,
        who: str,
        turns: int,
        *,
        window: bool = False,
        window_turns: int = 0,
        probe_every: int = 0,
        beside: Callable[[int], None] | None = None,
    ) -> tuple[list[float], int | None, Any, list[tuple[int, int]]]:
        """(seconds per turn, bytes the run added, counts, sampled (turn, bytes)).

        ``beside(i)`` runs right before turn ``i`` (a floor's turn, interleaved)."""
        win = self.env.window(config) if window else None
        samples: list[tuple[int, int]] = []
        with self.env.place(config) as place:
            size = place.size
            if who == "dbos":
                dbos = self.launch_dbos(config)
                size = self.dbos_size
            base = size()

            def probe(call: int) -> None:
                # The run's end is measured once it closed; the probes sample on the way.
                if probe_every and call % probe_every == 0 and call < turns:
                    samples.append((call, size() - base))
                if beside is not None and call < turns:
                    beside(call)

            probe_fn = probe if probe_every or beside else None
            if who == "ours":
                m = asyncio.run(
                    ours.run_turns(
                        place.url,
                        turns,
                        window=win,
                        window_turns=window_turns,
                        size=size,
                        probe=probe_fn,
                    )
                )
                return m.turn_seconds, m.bytes_added, m.counts, samples
            commits = 2 if who == "floor2" else 3
            if who.startswith("floor"):
                if config in SQLITE:
                    st = peers.sqlite_floor(
                        place.path, place.synchronous, commits, turns, win, window_turns, probe_fn
                    )
                elif config == "postgres":
                    st = peers.postgres_floor(
                        place.url, commits, turns, win, window_turns, probe_fn
                    )
                else:
                    st = peers.redis_floor(
                        self.env.redis[config].url, commits, turns, win, window_turns, probe_fn
                    )
            elif who == "langgraph":
                saver_cm = (
                    peers.langgraph_postgres(place.url)
                    if config == "postgres"
                    else peers.langgraph_sqlite(place.path, place.synchronous)
                )
                with saver_cm as saver:
                    base = size()
                    st = peers.langgraph_turns(saver, turns, win, window_turns, probe_fn)
            else:
                st = dbos.turns(turns, win, window_turns, probe_fn)
            return st.per_turn(), size() - base, st.counts, samples


def _median_turn(seconds: list[float]) -> float:
    return statistics.median(seconds[SKIP:] if len(seconds) > SKIP + 2 else seconds)


# --- the phases --------------------------------------------------------------------------


def _floor(run: Runner, config: str, place: Place, commits: int) -> peers.Floor:
    if config in SQLITE:
        return peers.SqliteFloor(place.path, place.synchronous, commits)
    if config == "postgres":
        return peers.PostgresFloor(place.url, commits)
    return peers.RedisFloor(run.env.redis[config].url, commits)


def paired(run: Runner, config: str, who: str, turns: int) -> dict[str, float]:
    """``who``'s turns with a 2-commit and a 3-commit floor turn right before each (on
    files or schemas of their own): the median seconds per turn of each."""
    if config == "memory":
        seconds, _, _, _ = run.measure(config, who, turns)
        return {"own": _median_turn(seconds)}
    with run.env.place(config) as place2, run.env.place(config) as place3:
        floors = [_floor(run, config, place2, 2), _floor(run, config, place3, 3)]
        spent: list[list[float]] = [[], []]

        def beside(i: int) -> None:
            # Alternate which floor goes first, so neither always follows our turn.
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for n in order:
                started = time.perf_counter()
                floors[n].turn(i)
                spent[n].append(time.perf_counter() - started)

        try:
            seconds, _, _, _ = run.measure(config, who, turns, beside=beside)
        finally:
            for floor in floors:
                floor.close()
    own = [s - a - b for s, a, b in zip(seconds, spent[0], spent[1], strict=False)]
    return {
        "own": _median_turn(own),
        "floor2": _median_turn(spent[0]),
        "floor3": _median_turn(spent[1]),
    }


def phase_per_turn(run: Runner, profile: Profile, res: Results, configs: list[str]) -> None:
    for config in configs:
        names = [w for w in who_for(config, profile) if not w.startswith("floor")]
        res.per_turn[config] = {n: [] for n in names}
        for rep in range(profile.reps):
            order = names if rep % 2 == 0 else list(reversed(names))
            for who in order:
                res.per_turn[config][who].append(paired(run, config, who, profile.turns))
        run.close_dbos()
        _say(f"  per turn: {config} done")


def phase_flat(run: Runner, profile: Profile, res: Results, configs: list[str]) -> None:
    pieces = min(10, max(2, profile.long // 20))
    for config in configs:
        if config == "redis-always" and "redis-everysec" in configs:
            continue  # the same scripts; only the server's fsync differs, measured per turn
        with run.env.place(config) as place:
            short = 5 if profile.name == "smoke" else 25
            seconds, pairs = asyncio.run(ours.flatness(place.url, profile.long, pieces, short))
        res.flat[config] = seconds
        res.flat_pairs[config] = pairs
    _say("  flatness done")


def phase_bytes(run: Runner, profile: Profile, res: Results) -> None:
    if not profile.bytes_turns:
        return
    every = max(1, profile.bytes_turns // 10)
    config = "sqlite-normal"
    for who in ("ours", "floor2", "langgraph", "dbos"):
        if who in ("langgraph", "dbos") and not profile.peers:
            continue
        cfg = "sqlite-full" if who == "dbos" else config
        seconds, added, _, samples = run.measure(cfg, who, profile.bytes_turns, probe_every=every)
        samples.append((profile.bytes_turns, added or 0))
        res.bytes_run[who] = samples
        if who == "langgraph":
            res.lg_curve = seconds
    run.close_dbos()
    _say("  bytes done")


def phase_resume(run: Runner, profile: Profile, res: Results, configs: list[str]) -> None:
    for config in configs:
        if config not in ("memory", "sqlite-normal", "postgres", "redis-everysec"):
            continue
        res.resume[config] = {}
        built_rate = 0.0  # seconds per turn to build the previous run
        for turns in profile.resume:
            if built_rate * turns > RESUME_BUDGET[profile.name]:
                res.notes.append(
                    f"resume at {turns:,} turns left out on {config}: building the run would "
                    f"take ~{built_rate * turns:.0f} s at this machine's pace"
                )
                continue
            with run.env.place(config) as place:
                seconds, _, built = asyncio.run(
                    ours.resume_costs(place.url, turns, profile.resumes)
                )
            built_rate = built / turns
            res.resume[config][f"ours@{turns}"] = seconds
            res.resume[config][f"build@{turns}"] = [built]
            if profile.peers and config in ("sqlite-normal", "postgres"):
                with run.env.place(config) as place:
                    saver_cm = (
                        peers.langgraph_postgres(place.url)
                        if config == "postgres"
                        else peers.langgraph_sqlite(place.path, place.synchronous)
                    )
                    with saver_cm as saver:
                        res.resume[config][f"langgraph@{turns}"] = peers.langgraph_get_state(
                            saver, turns, profile.resumes
                        )
        _say(f"  resume: {config} done")


def phase_concurrency(run: Runner, profile: Profile, res: Results, configs: list[str]) -> None:
    for config in configs:
        if config not in ("sqlite-full", "sqlite-normal", "postgres"):
            continue
        # The default (no write groups), which the targets are read on, and write groups,
        # which hold SQLite's one connection from a turn's first write to its commit.
        for grouped, name in ((False, config), (True, f"{config} (write groups)")):
            res.throughput[name] = {}
            for k in profile.ks:
                with run.env.place(config) as place:
                    rate = asyncio.run(
                        ours.throughput(place.url, k, profile.k_turns, grouped=grouped)
                    )
                res.throughput[name][str(k)] = rate
        _say(f"  concurrency: {config} done")


def phase_counts(run: Runner, profile: Profile, res: Results, configs: list[str]) -> None:
    counting.trace_sqlite()
    if "postgres" in configs:
        counting.trace_postgres()
    w = profile.window
    turns = w + 2 * SKIP
    for config in configs:
        if config == "memory":
            continue
        res.counts[config] = {}
        res.bytes_per_turn[config] = {}
        for who in who_for(config, profile):
            _, added, counts, _ = run.measure(config, who, turns, window=True, window_turns=w)
            if counts is not None:
                res.counts[config][who] = counts.per(w)
            if added is not None:
                res.bytes_per_turn[config][who] = added / turns
        run.close_dbos()
        win = run.env.window(config)
        first = profile.resume[0]
        for turns_before in (max(2, min(10, first // 10)), min(100, first)):
            with run.env.place(config) as place:
                _, counts, _ = asyncio.run(ours.resume_costs(place.url, turns_before, 0, win))
            if counts is not None:
                res.resume_counts[f"{config}@{turns_before}"] = counts.per(1)
        _say(f"  counts: {config} done")


_T0 = time.perf_counter()


def _say(text: str) -> None:
    print(f"{time.perf_counter() - _T0:6.1f} s {text}", file=sys.stderr, flush=True)


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%h %cI %s"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    head = out.stdout.strip()[:80]
    return head + (" (+ uncommitted changes in src/)" if dirty.stdout.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="a couple of minutes")
    group.add_argument("--smoke", action="store_true", help="memory and SQLite, seconds")
    parser.add_argument("--only", help="comma-separated configs: " + ", ".join(CONFIGS))
    parser.add_argument("--out", type=Path, help="results directory (default benchmarks/results)")
    args = parser.parse_args()
    profile = PROFILES["smoke" if args.smoke else "quick" if args.quick else "full"]
    counting.COUNT_FSYNCS = profile.name != "smoke"
    # The kit warns about Redis everysec on every opening; said once, in the notes.
    logging.getLogger("tesserix_adk").setLevel(logging.ERROR)
    configs = list(profile.configs)
    if args.only:
        configs = [c for c in args.only.split(",") if c]
        unknown = set(configs) - set(CONFIGS)
        if unknown:
            parser.error(f"unknown configs: {', '.join(sorted(unknown))}")
    res = Results(
        profile=profile.name,
        commit=_commit(),
        started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, SQLite {sqlite3.sqlite_version}",
    )
    if profile.peers:
        for module, what in (("langgraph", "LangGraph"), ("dbos", "DBOS")):
            try:
                __import__(module)
            except ImportError:
                res.notes.append(f'{what} is not installed (pip install -e ".[bench]"): left out')
    if any(c in REDIS for c in configs):
        res.notes.append(
            "Redis: throwaway servers with appendonly yes; redis-everysec may lose about one "
            "second of acknowledged writes on power loss, redis-always fsyncs before replying"
        )
    # Everything the run will use is imported now, so the code measured is the code as it
    # was when the run started, even while someone edits the working tree.
    for config, module in (("postgres", "postgres"), ("redis-everysec", "redis")):
        if config in configs or (module == "redis" and "redis-always" in configs):
            with contextlib.suppress(ImportError):
                __import__(f"tesserix_adk.adapters.{module}")
    with contextlib.ExitStack() as stack:
        env = Env(stack, tuple(configs))
        for config, why in env.missing.items():
            res.notes.append(f"{config} left out: {why}")
            configs.remove(config)
        run = Runner(env)
        started = time.perf_counter()
        _say(f"profile {profile.name} on {', '.join(configs)}")
        phase_per_turn(run, profile, res, configs)
        phase_flat(run, profile, res, configs)
        phase_bytes(run, profile, res) if "sqlite-normal" in configs else None
        phase_resume(run, profile, res, configs)
        phase_concurrency(run, profile, res, configs)
        phase_counts(run, profile, res, configs)
        run.close_dbos()
        res.notes.append(f"measured in {time.perf_counter() - started:.0f} s")
    print(report.text(res, profile), flush=True)
    if profile.name != "smoke" or args.out:
        out = args.out or RESULTS
        out.mkdir(parents=True, exist_ok=True)
        (out / f"turns-{profile.name}.json").write_text(json.dumps(asdict(res), indent=1))
        (out / f"turns-{profile.name}.md").write_text(report.markdown(res, profile))
        if profile.name != "smoke":
            report.plots(res, profile, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
