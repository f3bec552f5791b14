"""The tests, in three tiers: one directory each, every test module in exactly one of them.

tests/unit/         One process: no process group, no subprocess. Configs, the checker, models on CPU or
                    the meta device, the planner and the CLIs' main() called in-process.
                        python -m pytest tests/unit            (or anywhere: -m unit)
tests/distributed/  2-4 gloo ranks spawned in-process by tests.dist_utils.run_ranks (they meet through a
                    file, no port), often through tests.train_utils.train. Minutes.
                        python -m pytest tests/distributed     (or: -m distributed)
tests/cli/          Real commands as subprocesses: train.py, launch.sh and the deepspeed / torchrun / pdsh /
                    mpirun launchers (ports from tests.dist_utils.free_port), SIGTERM and resume, the plan
                    and prepare_data CLIs. The slowest; the launcher tests need sshd, pdsh and mpirun
                    (scripts/test.sh installs them).
                        python -m pytest tests/cli             (or: -m cli)
All of them: bash scripts/test.sh (python -m pytest -n 2 --dist loadfile: two pytest-xdist workers, each taking a
test module whole, the longest first: see pytest_collection_modifyitems).
One test: add -k (and -n 0 for one process).
Commands whose subject is not the launcher run in processes forked from the tests' server that has imported torch
and DeepSpeed (tests/helpers/commands.py run_command: a fresh interpreter spends about 7 CPU-seconds importing them).
Three more tiers, each a marker, mostly inside cli: `docs`, every command of README.md and docs/*.md run as written
(tests/cli/test_readme_commands.py, test_doc_figures.py, test_doc_parameter_counts.py); `slow`, minutes of end-to-end
runs: the family x layout matrix (test_family_matrix*.py), the device scripts' --tiny runs (test_gpu_check.py,
test_gpu_speed.py) and float8's (test_float8_cli.py, tests/distributed/test_float8_layouts.py); `cluster`, the real launchers (deepspeed, torchrun, pdsh over ssh, mpirun, Slurm,
launch.sh) on one host and across two hosts (namespace hosts with their own addresses, else loopback), signals and
lost nodes (test_launchers.py, test_netns_hosts.py, test_hang.py, test_resume_cli.py, test_launch.py). Skip the
three while iterating: -m "not docs and not slow and not cluster", the default tier; .ci/run runs them all. A run
ends with each tier's test seconds (pytest_terminal_summary); on the 2-core CI machine, 2026-11-28 (two workers,
seconds summed over both, OMP_NUM_THREADS=1 as scripts/test.sh sets it): unit 140, distributed 630, cli 354, cluster
653, docs 774, slow 307; the default tier 1125 (about 9.5 min of the two workers), the whole run 24 min of pytest
(.ci/run on a fresh clone, set-up included: 29 min). Since then each launcher that spans hosts runs once, in
test_netns_hosts.py (namespace hosts, loopback where none can be made): test_lost_node.py, test_slurm.py and
test_launchers.py's pdsh, Open MPI and two-node torchrun runs are gone, five launcher runs (about 200 of the cluster
tier's worker-s by the 2026-11-28 figures, estimated, not yet measured by a whole run).

A new test goes to the first tier that fits: unit unless it needs ranks (distributed) or a separate process
(cli). A module whose tests span tiers is split along test functions; what the parts share (helpers,
fixtures) goes to tests/helpers/<module>.py, which both import.

Shared helpers stay in tests/ (a package): tests/helpers/ (what test modules share: no test module imports
another, tests/unit/test_architecture.py holds it), tests.dist_utils, tests.train_utils, importable from every
tier because this file puts the repository root first on sys.path (the ranks run_ranks spawns inherit it).
Their asserts are rewritten as a test module's are (register_assert_rewrite below).
Each collected test gets its tier's marker (registered below); a test module outside the tiers is
collected and run as before, with a warning.
"""
import os
import pathlib
import sys

import pytest

# tests/helpers/' asserts report their operands as a test module's do (registered before anything imports them)
pytest.register_assert_rewrite("tests.helpers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)
# The environment's own tools first on PATH (as scripts/test.sh does): DeepSpeed keys its JIT-compiled
# ops on the ninja/compiler it finds, and a different one triggers a minute-long rebuild in every rank.
_bin = os.path.dirname(sys.executable)
if not os.environ.get("PATH", "").startswith(_bin + os.pathsep):
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")

TIERS = {"unit": "one process, no process group, no subprocess (tests/unit)",
         "distributed": "gloo ranks spawned in-process by tests.dist_utils.run_ranks (tests/distributed)",
         "cli": "real commands and launchers as subprocesses (tests/cli)"}
OWN_TIERS = ("docs", "slow", "cluster")      # markers inside tests/cli/, each left out of the default tier
HERE = pathlib.Path(__file__).resolve().parent


def pytest_configure(config):
    for name, description in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    config.addinivalue_line("markers", "docs: the documentation's commands and figures (tests/cli/test_readme_commands.py, "
                                       "test_doc_figures.py, test_doc_parameter_counts.py)")
    config.addinivalue_line("markers", "slow: minutes of end-to-end commands (tests/cli/test_family_matrix.py, "
                                       "test_family_matrix_2.py, the device scripts' --tiny runs, float8's); "
                                       "-m 'not slow' leaves them out, .ci/run runs them")
    config.addinivalue_line("markers", "cluster: the real launchers, signals and hosts (tests/cli/test_launchers.py, "
                                       "test_netns_hosts.py, ...); -m 'not cluster' leaves them out, .ci/run runs them")


# Under pytest-xdist (scripts/test.sh runs `-n 2 --dist loadfile`) a test module is the unit a worker takes whole, so
# its module and session fixtures are made once. The longest modules first: the one started last sets when the run
# ends. The docs tier is three modules (tests/cli/doc_runs.py) so that two workers share it.
LONGEST_FIRST = ("test_readme_commands.py", "test_doc_figures.py", "test_family_matrix.py", "test_family_matrix_2.py",
                 "test_netns_hosts.py", "test_doc_parameter_counts.py", "test_launchers.py", "test_anomaly_guard.py")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier (the first directory under tests/), so `-m unit` etc. select them; the longest
    modules first."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))        # stable: the rest keep their order
    outside = set()
    for item in items:
        parts = item.path.resolve().relative_to(HERE).parts if item.path.resolve().is_relative_to(HERE) else ()
        if len(parts) > 1 and parts[0] in TIERS:
            item.add_marker(parts[0])
        elif parts and item.path not in outside:
            outside.add(item.path)
            item.warn(pytest.PytestWarning(f"{item.path.name} is in none of tests/{{{','.join(TIERS)}}}: "
                                           "move it to its tier (tests/conftest.py says which)"))


def pytest_terminal_summary(terminalreporter):
    """Where the time went, by tier: the seconds each tier's tests took (setup, call and teardown, summed over the
    xdist workers), the marked tiers (OWN_TIERS) apart from the rest of their directory's (the default tier is
    everything but those: `-m "not docs and not slow and not cluster"`)."""
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport):
                continue
            keywords = report.keywords
            tier = next((name for name in OWN_TIERS if name in keywords), None) or \
                next((name for name in TIERS if name in keywords), "other")
            seconds[tier] = seconds.get(tier, 0.0) + report.duration
    if seconds:
        default = sum(s for tier, s in seconds.items() if tier not in OWN_TIERS)
        terminalreporter.write_line(
            "test seconds by tier (summed over workers): " + ", ".join(f"{tier} {s:.0f}" for tier, s in
                                                                       sorted(seconds.items()))
            + f"; default tier {default:.0f}, all {sum(seconds.values()):.0f}")
