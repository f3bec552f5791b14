"""Every command block of README.md and docs/*.md runs, and every figure they quote is what its command prints.

The blocks are read from the files (```bash fences, tests/cli/doc_blocks.py), so a new block is run without
touching this file. How each command runs, in short (the rules in full: tests/cli/doc_blocks.py):
  - planner commands (`parallel.plan`, `parallel.check`) exactly as written, with the real presets;
  - everything else in a copy of the repository whose released presets are tiny (sizes overridden, same keys;
    tests/cli/doc_sandbox.py), beside tiny random folders of the released layout (`CogVideoX-5b/`,
    `Wan2.1-T2V-14B-Diffusers/`, `clips/`), one sandbox for all, the documents in order (README first);
  - substitutions: `--num_gpus N` / `--nproc_per_node N` above 4 become 4; `--buckets` in pixels become the
    tiny preset's (`--buckets preset`); launchers get a free port;
  - doc_blocks.NOT_HERE lists what cannot run on this machine, each with the test that covers it.
Quoted output (`# ...` lines after a command, untagged ``` blocks after or beginning with `$ command`) must be in
what the command prints; FIGURES ties each figure quoted in prose to the command that prints it. Timings are
never asserted: the docs state them as measured, with a date. What a training run prints (its losses) is compared
to one unit of the quoted last digit: bf16 and several-rank sums round differently from one CPU to another.

Slow (every launch of the docs, the planner's searches): marked `docs`, a second tier that scripts/test.sh and
.ci/run still run; `-m "not docs"` leaves it out.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.cli import doc_blocks
from tests.cli.doc_blocks import DOCS, ROOT, blocks, matches, output_blocks, rule, substitute
from tests.dist_utils import free_port

# The programs a documented command may start with; another one fails test_every_command_has_a_rule.
PROGRAMS = re.compile(r"^(python -m (parallel\.\w+|bench|models)|deepspeed|torchrun|cp|bash scripts/\w+\.sh|"
                      r"\./launch\.sh|pip|echo)\b")
TIMEOUT = 600


def _run(command: str, prefix: list[str], cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(cwd), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(["bash", "-c", "\n".join([*prefix, command])], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


_AS_WRITTEN: dict[str, tuple[int, str]] = {}


def as_written(command: str, prefix: tuple[str, ...] = ()) -> tuple[int, str]:
    """A planner command from the repository root, exactly as written; one run for the same words (several
    documents and figures quote one search)."""
    key = " ".join([*prefix, command]).split()
    key = " ".join(key)
    if key not in _AS_WRITTEN:
        _AS_WRITTEN[key] = _run(command, list(prefix), ROOT)
    return _AS_WRITTEN[key]


@pytest.fixture(scope="session")
def sandbox_base(tmp_path_factory):
    from tests.cli.doc_sandbox import build
    return build(tmp_path_factory.mktemp("doc-sandbox"))


_DOC_RUNS: dict[str, dict[int, tuple[str, int, str]]] = {}


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
                results[command.line] = (how, *_run(substitute(command.text, free_port()), command.prefix, base))
    _DOC_RUNS[doc] = results
    return results


def test_every_command_has_a_rule():
    """A command that starts with an unknown program has no rule here: add one (or a NOT_HERE entry)."""
    unknown = [f"{b.name} line {c.line}: {c.text[:80]}" for doc in DOCS for b in blocks(doc) for c in b.commands
               if not PROGRAMS.match(c.expanded()) and rule(c, b)[0] != "not here"]
    assert not unknown, "commands with no rule in tests/cli/doc_blocks.py:\n" + "\n".join(unknown)
    keys = {key for key in doc_blocks.NOT_HERE
            if not any(rule(c, b)[1] == doc_blocks.NOT_HERE[key] for d in DOCS for b in blocks(d) for c in b.commands)}
    assert not keys, f"NOT_HERE entries that match no command any more: {sorted(keys)}"


def test_a_training_figure_may_differ_by_one_unit_of_its_last_digit_a_planner_figure_not():
    quoted = "step 2: validation loss 0.6179 (t100=0.9938 t300=0.7474)"
    printed = "x step 2: validation loss 0.6179 (t100=0.9937 t300=0.7475) y"
    assert matches(quoted, printed, last_digit=True) and not matches(quoted, printed)
    assert not matches(quoted, printed.replace("0.9937", "0.9936"), last_digit=True)
    assert not matches(quoted, printed.replace("step 2", "step 4"), last_digit=True)
    assert matches("a ... total 14.89 GiB", "a b total 14.90 GiB", last_digit=True)


def expected_failure(quoted: list[str]) -> bool:
    """A quoted refusal (`python -m parallel.check refused (1 problem):`): the command is shown failing on purpose."""
    return bool(quoted) and re.search(r" refused \(\d+ problems?\):$", quoted[0]) is not None


@pytest.mark.docs
@pytest.mark.parametrize("doc", [d for d in DOCS if any(rule(c, b)[0] != "not here"
                                                         for b in blocks(d) for c in b.commands)])
def test_doc_commands_run_and_print_what_they_quote(doc, sandbox_base, tmp_path_factory):
    results = run_doc(doc, sandbox_base)
    failures = []
    for block in blocks(doc):
        for command in block.commands:
            how, code, output = results[command.line]
            if how == "not here":
                continue
            where = f"{doc}:{command.line} ({how}): {command.text[:100]}"
            if (code != 0) != expected_failure(command.quoted):
                failures.append(f"{where}\n  exit status {code}; output ends:\n{output[-1500:]}")
            elif command.quoted and not matches(" ".join(command.quoted), output, last_digit=how == "sandbox"):
                failures.append(f"{where}\n  quoted: {' '.join(command.quoted)}\n  not in its output:\n{output[-1500:]}")
    assert not failures, "\n\n".join(failures)


# --- figures quoted in prose and output blocks: each from the command that prints it -------------------------

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
             ("docs/sequence-parallel.md", 69): "docs/sequence-parallel.md|parallel.plan"}


# Under pytest-xdist (tests/conftest.py) the documents' commands are one unit, run in order in one sandbox; the
# figures and output blocks of commands run as written (the planner's, `python -m models`) are a second unit that
# another worker takes meanwhile. A figure of a sandbox command stays with the documents' unit.
# `python -m models`' parameter counts are a third.
AS_WRITTEN_UNIT = pytest.mark.xdist_group("docs: the planner's figures, as written")
MODELS_UNIT = pytest.mark.xdist_group("docs: python -m models' parameter counts")


def _unit(source: str):
    if re.match(r"^[\w./-]+\.md\|", source):
        block, command = command_at(source)
        if rule(command, block)[0] != "as written":
            return ()
    return (MODELS_UNIT if source.startswith("python -m models ") else AS_WRITTEN_UNIT,)


@pytest.mark.docs
@pytest.mark.parametrize("doc, pattern, source, extract",
                         [pytest.param(*f, id=f"{f[0]}:{i}", marks=_unit(f[2])) for i, f in enumerate(FIGURES)])
def test_quoted_figures_are_what_the_commands_print(doc, pattern, source, extract, sandbox_base_lazy,
                                                    tmp_path_factory):
    quoted = re.search(pattern, (ROOT / doc).read_text(), re.M)
    assert quoted, f"{doc}: the figure /{pattern}/ is gone: update FIGURES in {__file__}"
    printed = extract(output_of(source, sandbox_base_lazy, tmp_path_factory))
    # a training run's losses (the demo's loss line) to one unit of their last digit; the planners' figures exactly
    same = matches(quoted.group(1), printed, last_digit=True) if extract is loss_line else printed == quoted.group(1)
    assert same, f"{doc} quotes {quoted.group(1)!r}; {source} prints {printed!r}"


@pytest.mark.docs
@pytest.mark.parametrize("doc, line, lines", [
    pytest.param(d, n, ls, id=f"{d}:{n}", marks=_unit(OUTPUT_OF.get((d, n), "as written")))
    for d in DOCS for n, ls in output_blocks(d)])
def test_output_blocks_are_what_the_commands_print(doc, line, lines, sandbox_base_lazy, tmp_path_factory):
    if lines and lines[0].startswith("$ "):
        command, rest = "", list(lines)
        while rest and (not command or command.endswith("\\")):
            command = command[:-1] + " " + rest.pop(0).lstrip("$ ").strip() if command else rest.pop(0)[2:].strip()
        output = output_of(command, sandbox_base_lazy, tmp_path_factory)
    else:
        assert (doc, line) in OUTPUT_OF, f"{doc}:{line}: an output block: begin it with `$ command` or name its " \
                                         f"command in OUTPUT_OF ({__file__})"
        output, rest = output_of(OUTPUT_OF[doc, line], sandbox_base_lazy, tmp_path_factory), lines
    missing = [text for text in rest if text.strip().strip(".") and not matches(text, output)]
    assert not missing, f"{doc}:{line}: lines not in the output of its command:\n" + "\n".join(missing) + \
                        f"\n--- the output:\n{output[-3000:]}"


@pytest.fixture(scope="session")
def sandbox_base_lazy(request):
    """The sandbox, built only when a figure's command runs in it."""
    return lambda: request.getfixturevalue("sandbox_base")
