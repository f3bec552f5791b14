"""A command as a user types it (`python train.py ...`, `python -m parallel.export ...`), run in processes forked
from the tests' server that has imported torch, DeepSpeed, dynamo and the oracles once (tests.dist_utils'
forkserver), not in a fresh interpreter: a fresh one spends about 7 CPU-seconds importing them before the
command's first line (3 of them torch, 2.6 dynamo), more than most tests' commands do after it.

`run_command(argv, ranks=N)` runs the script, module or -c program as `python` would (`__main__`, sys.argv,
sys.path[0], SystemExit's code, an uncaught exception's traceback on stderr and status 1, the atexit handlers), with
the caller's environment and folder at the call and the file descriptors 1 and 2 of every rank captured, and returns
a subprocess.CompletedProcess. With ranks > 1, each rank gets what torchrun gives its ranks (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: a port from tests.dist_utils.free_port; OMP_NUM_THREADS=1
unless set): the command makes its process group itself, through env://, as under a launcher; the status is the
first failing rank's, the output every rank's in rank order, as a launcher prints them (not interleaved).

What stays a subprocess: a launcher itself (tests/cli/test_launchers.py, test_netns_hosts.py), a
signal sent to a command (test_resume_cli.py, test_hang.py), and a command whose environment changes what the
server imported (DS_ACCELERATOR; test_nccl_double.py's sitecustomize on PYTHONPATH: deepspeed picks its accelerator
once, at its import): run_command refuses those."""
from __future__ import annotations

import atexit
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
import types

import torch
import torch.multiprocessing as mp

from tests.dist_utils import free_port
from tests.helpers.launch_env import without_launcher_vars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What the server imported read these when it imported: a command that changes them needs a fresh interpreter
IMPORT_TIME = ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


def _exit_status(code) -> int:
    """SystemExit's code as the interpreter turns it into a status: None 0, an int itself, else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _command(argv, environ, cwd, out_path, err_path):
    """A forked process's life as `python *argv` (the file descriptors first, so C++ output is captured too)."""
    for fd, path in ((1, out_path), (2, err_path)):
        sys.stdout.flush()
        sys.stderr.flush()
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    if environ.get("OMP_NUM_THREADS", "").isdigit():       # torch reads it at its import, as a fresh process would
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]           # run_module puts the module's file in argv[0]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException as e:     # noqa: BLE001  (the interpreter's own: the traceback from the program, status 1)
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_command(argv, ranks: int = 1, env: dict | None = None, cwd: str = ROOT, timeout: float = 300,
                env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`python *argv` (argv: a script and its arguments, or "-m", a module and its) in `ranks` forked processes: a
    CompletedProcess (args, returncode, stdout, stderr text). `env`: the whole environment (default: this
    process's, without a launcher's variables), `env_extra` added to it."""
    argv = [str(a) for a in argv]
    environ = dict(env) if env is not None else without_launcher_vars()
    environ.update(env_extra or {})
    changed = [k for k in IMPORT_TIME if environ.get(k) != os.environ.get(k)]
    changed += [f"PYTHONPATH's {p}" for p in environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.abspath(p) not in map(os.path.abspath, sys.path)]      # a sitecustomize there, say
    if changed:
        raise ValueError(f"{', '.join(changed)}: not as the server that imported torch and DeepSpeed had it; run "
                         "this command with subprocess")
    ctx = mp.get_context("forkserver")
    with tempfile.TemporaryDirectory() as folder:
        port = str(free_port()) if ranks > 1 else None
        procs = []
        for rank in range(ranks):
            rank_env = dict(environ)
            if ranks > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                                LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                rank_env.setdefault("OMP_NUM_THREADS", "1")         # torchrun's, where the caller set none
            p = ctx.Process(target=_command, args=(argv, rank_env, str(cwd), os.path.join(folder, f"{rank}.out"),
                                                   os.path.join(folder, f"{rank}.err")))
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        codes = [None] * ranks
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    p.join(timeout=0.05)
                    codes[i] = p.exitcode
            failed = [c for c in codes if c not in (None, 0)]
            if failed and ranks > 1:        # a launcher stops the other ranks when one fails
                time.sleep(5)
                for i, p in enumerate(procs):
                    if p.exitcode is None:
                        p.kill()
                    p.join()
                    codes[i] = p.exitcode
            if time.monotonic() > deadline and any(c is None for c in codes):
                for p in procs:
                    p.kill()
                    p.join()
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=_read(folder, "out", ranks),
                                                stderr=_read(folder, "err", ranks))
        status = next((c for c in codes if c != 0), 0)
        return subprocess.CompletedProcess([sys.executable, *argv], status, _read(folder, "out", ranks),
                                           _read(folder, "err", ranks))


def _read(folder: str, stream: str, ranks: int) -> str:
    parts = []
    for rank in range(ranks):
        path = os.path.join(folder, f"{rank}.{stream}")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                parts.append(f.read())
    return "".join(parts)
