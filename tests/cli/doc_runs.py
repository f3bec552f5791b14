"""What the documentation tests share (tests/cli/test_readme_commands.py, test_doc_figures.py,
test_doc_parameter_counts.py): running a documented command (as written, or in the sandbox in document order), the
figures quoted in prose with the command that prints each, and the checks of a figure and of an output block.

Three test modules, so that pytest-xdist (scripts/test.sh, `--dist loadfile`) gives them to different workers: the
documents' commands in one sandbox in order (and the figures of those commands), the planner's figures, and
`python -m models`' parameter counts.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest
from filelock import FileLock

from tests.cli import doc_blocks
from tests.cli.doc_blocks import DOCS, MAX_PROCS, ROOT, blocks, matches, rule, substitute
from tests.dist_utils import free_port

TIMEOUT = 600


def suite_environment(cwd: Path) -> dict[str, str]:
    """VDP_VENV=the suite's own environment when it is current for cwd's pyproject.toml and scripts/env.sh (their
    stamp, as env.sh names it, is there): scripts/demo.sh in the sandbox then sets up nothing, where it would
    install a second environment (minutes); that install is what .ci/run's own set-up has just done, and
    tests/cli/test_install.py checks env.sh's choices. Another stamp (a checkout whose env.sh differs): none."""
    recipe = (cwd / "pyproject.toml").read_bytes() + (cwd / "scripts" / "env.sh").read_bytes()
    stamp = Path(sys.prefix) / f".installed-{hashlib.sha1(recipe).hexdigest()[:12]}"
    return {"VDP_VENV": sys.prefix} if stamp.exists() else {}


def _run(command: str, prefix: list[str], cwd: Path) -> tuple[int, str]:
    # MASTER_PORT: a script's own launcher (scripts/demo.sh) rendezvouses on a free port, not on 29500, which
    # another job on this machine may hold (a second suite's demo did)
    env = {**os.environ, "PYTHONPATH": str(cwd), "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(free_port()),
           **suite_environment(cwd)}
    proc = subprocess.run(["bash", "-c", "\n".join([*prefix, command])], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


# `python -m` of these runs in this process: the module's __main__ with the argv the shell gives it (runpy, as
# `python -m` runs it), its exit status and what it prints; a fresh interpreter would spend seconds importing
# torch for a plan that takes less. They start no process group and keep nothing between runs but caches.
IN_PROCESS = ("parallel.plan", "parallel.check", "models")
SHELL = re.compile(r"[|<>;&`]")


def _argv(command: str, prefix: list[str]) -> list[str]:
    """The argv bash makes of the command (the block's assignments before it)."""
    script = "\n".join([*prefix, f"set -- {command}", 'printf "%s\\0" "$@"'])
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split("\0")[:-1]


def _run_in_process(module: str, args: list[str]) -> tuple[int, str]:
    out, argv, code = io.StringIO(), sys.argv, 0
    sys.argv = [module, *args]
    try:
        with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
                warnings.catch_warnings():
            # runpy's note that the module was imported before (by an earlier run): `python -m` never sees it
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            out.write(e.code + "\n")
    except Exception:
        code = 1
        out.write(traceback.format_exc())
    finally:
        sys.argv = argv
    return code, out.getvalue()


def _run_as_written(command: str, prefix: list[str]) -> tuple[int, str]:
    if not SHELL.search(command):
        argv = _argv(command, prefix)
        if argv[:2] == ["python", "-m"] and len(argv) > 2 and argv[2] in IN_PROCESS:
            return _run_in_process(argv[2], argv[3:])
    return _run(command, prefix, ROOT)


_SHARED: list[Path] = []


def share_answers_in(folder: Path) -> None:
    """Where as_written keeps its answers (tests/cli/conftest.py: a folder of the whole pytest run)."""
    folder.mkdir(parents=True, exist_ok=True)
    _SHARED[:] = [folder]


def as_written(command: str, prefix: tuple[str, ...] = ()) -> tuple[int, str]:
    """A planner command from the repository root, exactly as written; one run for the same words in the whole
    session (several documents and figures quote one search, and pytest-xdist's workers share the answer through
    a file beside their temporary folders: the first to ask runs it, the other waits for it)."""
    key = " ".join(" ".join([*prefix, command]).split())
    path = _SHARED[0] / f"as-written-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            code, output = _run_as_written(command, list(prefix))
            path.write_text(json.dumps({"command": key, "code": code, "output": output}))
        found = json.loads(path.read_text())
    return found["code"], found["output"]


def processes(words: str, base: Path) -> int:
    """The fewest processes, at least 2 (data parallelism where the layout is one rank), that hold a command's layout:
    tp x sp x pp (x dp where set) of its --config (the sandbox's tiny preset) with its --set overrides. Every rank imports torch,
    DeepSpeed and the toolkit (about 5 CPU-seconds on this machine), and the commands' subjects here are the
    commands, not data parallelism at 4 (tests/distributed/test_train_equivalence.py). MAX_PROCS where the command
    names no config or its config does not load (the command then says why itself)."""
    argv = words.split()
    if "--config" not in argv:
        return MAX_PROCS
    name = argv[argv.index("--config") + 1]
    path = base / name if (base / name).exists() else base / "configs" / f"{name}.yaml"
    sets = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--set"]
    try:
        from parallel.experiment.config import load_config
        p = load_config(str(path), sets).parallel
    except Exception:                       # noqa: BLE001  (the command itself reports a config it refuses)
        return MAX_PROCS
    return min(MAX_PROCS, max(2, p.tp_size * p.sp_size * p.pp_size * (p.dp_size or 1)))


_DOC_RUNS: dict[str, dict[int, tuple[str, int, str]]] = {}
_SANDBOX_RUNS: dict[str, tuple[int, str]] = {}


def run_doc(doc: str, base: Path) -> dict[int, tuple[str, int, str]]:
    """{first line of a command: (how it ran, exit status, output)} for every command of `doc`, in order. The
    documents share one sandbox and run in DOCS order (README first), as a reader follows them: a doc's
    command may read what an earlier one made (data/wan, a run's checkpoints)."""
    for earlier in DOCS[:DOCS.index(doc)]:
        if earlier not in _DOC_RUNS:
            run_doc(earlier, base)
    if doc in _DOC_RUNS:
        return _DOC_RUNS[doc]
    results = {}
    for block in blocks(doc):
        for command in block.commands:
            how, reason = rule(command, block)
            if how == "not here":
                results[command.line] = (how, 0, reason)
            elif how == "as written":
                results[command.line] = (how, *as_written(command.text, tuple(command.prefix)))
            else:
                # The same words, their variables expanded, as a command an earlier document (or block) ran in this
                # sandbox: a reader who follows both runs it once (a second export into the same folder would be
                # refused), and so does the test: its result is the earlier one's. Words as the shell splits them:
                # a trailing `# -> ...` comment is not part of the command.
                words = " ".join(shlex.split(command.expanded(), comments=True))
                if words not in _SANDBOX_RUNS:
                    _SANDBOX_RUNS[words] = _run(substitute(command.text, free_port(), processes(words, base)),
                                                command.prefix, base)
                results[command.line] = (how, *_SANDBOX_RUNS[words])
    _DOC_RUNS[doc] = results
    return results


def command_at(source: str) -> tuple[doc_blocks.Block, doc_blocks.Command]:
    """`doc|words`: the first command of doc that contains the words (line numbers drift as docs are edited)."""
    doc, needle = source.split("|", 1)
    for block in blocks(doc):
        for command in block.commands:
            if needle in command.text:
                return block, command
    raise AssertionError(f"{doc}: no command contains {needle!r} any more; update FIGURES / OUTPUT_OF")


def output_of(source: str, base, tmp_path_factory) -> str:
    """The output of a documented command (`doc|words`) or of a command given in full (run as written)."""
    if not re.match(r"^[\w./-]+\.md\|", source):
        code, output = as_written(source)
    else:
        block, command = command_at(source)
        if rule(command, block)[0] == "as written":
            code, output = as_written(command.text, tuple(command.prefix))
        else:
            _, code, output = run_doc(block.doc, base())[command.line]
    assert code == 0, f"{source} failed ({code}):\n{output[-2000:]}"
    return output


def value(name: str):
    """A line of the plan's table: `activations   15.30`."""
    return lambda output: re.search(rf"^{re.escape(name)}\s+([\d.]+)$", output, re.M).group(1)


total = value("total")


ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d)\s+\S+\s+\d+\s+([\d.]+)\s", re.M)


def row(tp, sp, pp, dp, zero, digits=1, first=False):
    """The GiB of the best-ranked search row with this layout (first=True: and it must be ranked first)."""
    def extract(output: str) -> str:
        rows = [tuple(map(int, r[:6])) + (float(r[6]),) for r in ROW.findall(output)]
        found = [r for r in rows if r[1:6] == (tp, sp, pp, dp, zero)]
        if not found or (first and found[0] != rows[0]):
            return f"not {'first' if first else 'found'}: ranked {rows[:3]}"
        return f"{found[0][6]:.{digits}f}"
    return extract


def parameters(output: str) -> str:
    count = int(re.search(r"^parameters: (\d+)", output, re.M).group(1))
    return f"{count:,}"


def loss_line(output: str) -> str:
    return re.search(r"(loss: mean of the first \d+ steps .*?\))", output).group(1)


PLAN = "python -m parallel.plan --config configs/{} --deepspeed_config ds_configs/zero1_bf16.json --world-size {} " \
       "--device-memory 80GiB --search"
WAN_16 = PLAN.format("wan2.1-t2v-14b.yaml", 16)
SEARCH = {name: PLAN.format(f"{name}.yaml", 8) for name in
          ("cogvideox-2b", "cogvideox-5b-i2v", "cogvideox1.5-5b", "cogvideox1.5-5b-i2v")}
LONG_SP1 = "python -m parallel.plan --config configs/cogvideox-5b-long.yaml --deepspeed_config " \
           "ds_configs/zero2_bf16_long.json --world-size 8 --device-memory 80GiB --set parallel.sp_size=1"
HY15 = "python -m parallel.plan --config configs/hunyuanvideo1.5-t2v-{}.yaml --deepspeed_config " \
       "ds_configs/zero3_bf16.json --world-size 8 --device-memory 80GiB"
PRESETS = re.findall(r"^\| `([\w.-]+)` \| \w+ \| [\d,]+ \|", (ROOT / "README.md").read_text(), re.M)
# README.md's preset table: each 2026 preset's plan on 8 x 80 GB at its own layout, GiB a rank (the `total` line) with
# the DeepSpeed JSON its `parallel:` comment names; the A14B presets one expert per run (both do not fit).
A14B_ONE = " --set model.experts.train=high_noise"
PRESET_PLANS = {"wan2.1-t2v-14b": ("zero3", ""), "wan2.1-i2v-14b-480p": ("zero3", ""),
                "wan2.1-i2v-14b-720p": ("zero3", ""), "wan2.2-t2v-a14b": ("zero3", A14B_ONE),
                "wan2.2-i2v-a14b": ("zero3", A14B_ONE), "wan2.2-ti2v-5b": ("zero2", ""),
                "hunyuanvideo-t2v": ("zero3", ""), "opensora2.0": ("zero3", ""),
                "hunyuanvideo1.5-t2v-480p": ("zero3", ""), "hunyuanvideo1.5-t2v-720p": ("zero3", ""),
                "hunyuanvideo1.5-i2v-720p": ("zero3", "")}
PRESET_PLAN = "python -m parallel.plan --config configs/{}.yaml --deepspeed_config ds_configs/{}_bf16.json " \
              "--world-size 8 --device-memory 80GiB{}"

# (doc, a regex on the doc with one group: the figure, the command that prints it, what to read from its output)
FIGURES = [
    ("README.md", r"`(loss: mean of the first 10 steps [^`]*)`", "README.md|scripts/demo.sh", loss_line),
    ("docs/training.md", r"`(loss: mean of the first 10 steps [^`]*)`", "README.md|scripts/demo.sh", loss_line),
    ("README.md", r"([\d.]+) GiB a rank with rank-64 adapters", "README.md|parallel.plan $L", total),
    ("README.md", r"([\d.]+) GiB for full fine-tuning", "docs/planner.md|--device-profile a100-80gb --set parallel.tp_size=2", total),
    ("docs/lora.md", r"([\d.]+) GiB per rank at rank 64", "docs/lora.md|parallel.plan", total),
    ("docs/lora.md", r"at rank 64, ([\d.]+) GiB\s+for full", "docs/planner.md|--device-profile a100-80gb --set parallel.tp_size=2", total),
    ("README.md", r"preset's sp 2 x dp 4, ZeRO-3 \(([\d.]+) GiB a rank\)", "README.md|parallel.plan $W", row(1, 2, 1, 4, 3)),
    ("docs/models.md", r"first on 8 x 80 GB \(([\d.]+) GiB per rank", "README.md|parallel.plan $W", row(1, 2, 1, 4, 3, first=True)),
    ("README.md", r"tp 2 x sp 2 x dp 4, ZeRO-2 \(([\d.]+) GiB\)", WAN_16, row(2, 2, 1, 4, 2)),
    ("docs/models.md", r"tp 2 x sp 2 x dp 4, ZeRO-2 \(([\d.]+) GiB\)", WAN_16, row(2, 2, 1, 4, 2)),
    ("docs/released-weights.md", r"`cogvideox-2b`: dp 8 ZeRO-1 \((\d+) GiB\)", SEARCH["cogvideox-2b"],
     row(1, 1, 1, 8, 1, 0, first=True)),
    ("docs/released-weights.md", r"`cogvideox-5b`: tp 2 x sp 2 x dp 2 ZeRO-2 \((\d+) GiB\)",
     "docs/released-weights.md|--search", row(2, 2, 1, 2, 2, 0, first=True)),
    ("docs/released-weights.md", r"`cogvideox-5b-i2v` the same \((\d+) GiB\)", SEARCH["cogvideox-5b-i2v"],
     row(2, 2, 1, 2, 2, 0, first=True)),
    ("docs/released-weights.md", r"`cogvideox1.5-5b-i2v`: sp 8 ZeRO-2 \((\d+) GiB\)", SEARCH["cogvideox1.5-5b"],
     row(1, 8, 1, 1, 2, 0, first=True)),
    ("docs/released-weights.md", r"`cogvideox1.5-5b-i2v`: sp 8 ZeRO-2 \((\d+) GiB\)", SEARCH["cogvideox1.5-5b-i2v"],
     row(1, 8, 1, 1, 2, 0, first=True)),
    ("docs/sequence-parallel.md", r"at tp 2 and sp 1 needs ([\d.]+) GiB", LONG_SP1, total),
    ("docs/sequence-parallel.md", r"at tp 2 and sp 1 needs [\d.]+ GiB \(activations ([\d.]+)", LONG_SP1,
     value("activations")),
    ("docs/sequence-parallel.md", r"at tp 2 and sp 1 needs .*?, recompute ([\d.]+)\)", LONG_SP1,
     value("recompute (1 segment)")),
    ("docs/models.md", r"ZeRO-2, no checkpointing first on 8 x 80 GB \(([\d.]+)\s+GiB", PLAN.format("wan2.2-ti2v-5b.yaml", 8),
     row(1, 8, 1, 1, 2, 2, first=True)),
    ("docs/models.md", r"plans the preset \(tp 1 x sp 8, ZeRO-3, every block recomputed\)\s+at ([\d.]+) GiB",
     HY15.format("720p"), total),
    ("docs/models.md", r"every second block recomputed first \(([\d.]+) GiB per rank\)", HY15.format("720p") +
     " --search", row(1, 8, 1, 1, 3, 2, first=True)),
    ("docs/models.md", r"ZeRO-3 and no recomputation first \(([\d.]+) GiB per rank\)", HY15.format("480p") +
     " --search", row(1, 8, 1, 1, 3, 2, first=True)),
    *[("README.md", rf"^\| `{re.escape(name)}` \| \w+ \| ([\d,]+) \|", f"python -m models --config configs/{name}.yaml",
       parameters) for name in PRESETS],
    *[("README.md", rf"^\| `{re.escape(name)}` \|.*ZeRO-{zero[-1]}[^|]*: ([\d.]+) GiB[^|]*\|$",
       PRESET_PLAN.format(name, zero, extra), total) for name, (zero, extra) in PRESET_PLANS.items()],
    ("README.md", r"one expert per run at the preset's sp 8, ZeRO-3\s+does \(([\d.]+) GiB a rank\)", "README.md|parallel.plan $A $H",
     total),
    ("README.md", r"HunyuanVideo 1.5 at 720p plans\s+([\d.]+) GiB a rank at sp 8", HY15.format("720p"), total),
    ("docs/models.md", r"as written recomputes every block: ([\d.]+) GiB", PRESET_PLAN.format("wan2.2-ti2v-5b", "zero2", ""),
     total),
]

# Untagged ``` blocks: a command's output. Those that do not begin with `$ command` name their command here.
OUTPUT_OF = {("docs/planner.md", 47): "docs/planner.md|--device-profile a100-80gb --set parallel.tp_size=2", ("docs/planner.md", 88): "docs/planner.md|--search",
             ("docs/sequence-parallel.md", 72): "docs/sequence-parallel.md|parallel.plan"}




def needs_sandbox(source: str) -> bool:
    """A figure's command is a documented one that runs in the sandbox (not as written)."""
    if not re.match(r"^[\w./-]+\.md\|", source):
        return False
    block, command = command_at(source)
    return rule(command, block)[0] != "as written"


def is_parameter_count(source: str) -> bool:
    return source.startswith("python -m models ")


def figures(where) -> list:
    """FIGURES whose command `where(source)` selects, as pytest params."""
    return [pytest.param(*f, id=f"{f[0]}:{i}") for i, f in enumerate(FIGURES) if where(f[2])]


def output_block_params(where) -> list:
    """Each untagged output block of the docs whose command `where(source)` selects."""
    return [pytest.param(d, n, ls, id=f"{d}:{n}") for d in DOCS for n, ls in doc_blocks.output_blocks(d)
            if where(OUTPUT_OF.get((d, n), "as written"))]


def check_figure(doc, pattern, source, extract, base) -> None:
    quoted = re.search(pattern, (ROOT / doc).read_text(), re.M)
    assert quoted, f"{doc}: the figure /{pattern}/ is gone: update FIGURES in {__file__}"
    printed = extract(output_of(source, base, None))
    # a training run's losses (the demo's loss line) to one unit of their last digit; the planners' figures exactly
    same = matches(quoted.group(1), printed, last_digit=True) if extract is loss_line else printed == quoted.group(1)
    assert same, f"{doc} quotes {quoted.group(1)!r}; {source} prints {printed!r}"


def check_output_block(doc, line, lines, base) -> None:
    if lines and lines[0].startswith("$ "):
        command, rest = "", list(lines)
        while rest and (not command or command.endswith("\\")):
            command = command[:-1] + " " + rest.pop(0).lstrip("$ ").strip() if command else rest.pop(0)[2:].strip()
        output = output_of(command, base, None)
    else:
        assert (doc, line) in OUTPUT_OF, f"{doc}:{line}: an output block: begin it with `$ command` or name its " \
                                         f"command in OUTPUT_OF ({__file__})"
        output, rest = output_of(OUTPUT_OF[doc, line], base, None), lines
    missing = [text for text in rest if text.strip().strip(".") and not matches(text, output)]
    assert not missing, f"{doc}:{line}: lines not in the output of its command:\n" + "\n".join(missing) + \
                        f"\n--- the output:\n{output[-3000:]}"
