"""The ```bash blocks of README.md and docs/*.md, split into commands, and the rules that say how each runs here.

A block is split into logical lines (backslash continuations joined). A line of assignments only
(`L="--config ..."`) is kept and put before every later command of its block. `# ...` lines after a command,
ended by a blank line or the block's end, are its quoted output, compared with what it prints (`...` matches
anything); `#` lines followed directly by a command are a heading for it.

The rules, the first that matches wins (tests/cli/test_readme_commands.py runs them):
  NOT_HERE   an explicit list: the command cannot run on this machine; the reason names the test that covers it.
  PLANNER    `python -m parallel.plan` and `python -m parallel.check` only size and check: run as written
             (the argv bash makes of the words, in this process as `python -m` runs a module: doc_runs.py),
             with the real presets, unless they read a folder an earlier command made (data.path=,
             model.init_from=): then in the sandbox, against the tiny presets, as the commands that made it.
  SANDBOX    everything else runs in a copy of the repository whose released presets are tiny (same keys,
             sizes overridden: tests/cli/doc_sandbox.py) beside tiny random release folders of the released
             layout (`CogVideoX-5b/`, `Wan2.1-T2V-14B-Diffusers/`, clips), with three substitutions: a process
             count (`--num_gpus 8`, `--nproc_per_node 8`) becomes the fewest processes, at least 2, that hold
             the command's layout (tp x sp x pp of its config and --set; 4 at most), what a 2-core CPU can run; clip
             sizes in pixels (`--buckets 49x480x720,...`) become the tiny preset's (`--buckets preset`); and
             `deepspeed`/`torchrun` get a free `--master_port` (other jobs share this machine).
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
MAX_PROCS = 4
PROCS = re.compile(r"(--num_gpus|--nproc_per_node|--nproc-per-node|--num-gpus)([ =])(\d+)")
PLANNER = re.compile(r"^python -m parallel\.(plan|check)\b")
READS_SANDBOX = re.compile(r"data\.path=|model\.init_from=")
ASSIGNMENTS = re.compile(r'^(\w+=("[^"]*"|\S+)\s*)+$')

# Commands that cannot run here, by a substring of the command: the reason, and the test that covers them.
NOT_HERE = {
    "bash scripts/test.sh": "the whole test suite, this test among them; each tier runs on its own in .ci/run",
    "bash scripts/bench.sh": "the benchmark (about 6 minutes alone, timings); tests/unit/test_bench_peer.py",
    "python -m bench --only peer": "the benchmark's peer section (timings); tests/unit/test_bench_peer.py",
    "pip install": "installs packages (scripts/env.sh does it); the suite runs in that environment",
    "prepare_data ...": "an abbreviation (`...` for the flags of the command above it), not a command",
    "python -m parallel.plan ...": "an abbreviation (`...` for the flags above); tests/cli/test_plan_cli.py and "
                                   "tests/unit/test_plan*.py run --format json/markdown and --png",
    "deepspeed --hostfile hosts ": "a cluster's hostfile; tests/cli/test_netns_hosts.py runs one across two hosts",
    "--hostfile hosts8": "an 8-GPU cluster's hostfile and a placeholder c.yaml; the layout change it shows: "
                         "tests/distributed/test_relayout.py, the launcher: tests/cli/test_netns_hosts.py",
    "--hostfile hosts4": "a 4-GPU cluster's hostfile and a placeholder c.yaml; tests/distributed/test_relayout.py",
    "runs/demo-...": "what scripts/demo.sh runs (README.md's first block runs the script)",
    "--device npu": "needs Ascend NPUs; tests/cli/test_launch.py checks the command launch.sh runs for them",
    "#SBATCH": "a Slurm batch script; tests/cli/test_netns_hosts.py::test_slurm_sbatch submits it to a two-node "
               "Slurm cluster",
    "--config run.yaml": "placeholders (run.yaml, ds.json, p.safetensors): tests/distributed/test_sample_layouts.py "
                         "samples in every layout against CogVideoXPipeline",
}


@dataclass
class Command:
    text: str                       # one logical line, continuations joined
    line: int                       # its first line in the file
    prefix: list[str]               # the block's assignment lines before it
    quoted: list[str] = field(default_factory=list)    # the `# ...` lines right after it: its output

    def expanded(self) -> str:
        """The command with the block's $VARIABLES substituted (to classify it, not to run it)."""
        values = {}
        for line in self.prefix:
            for name, value in re.findall(r'(\w+)=("[^"]*"|\S+)', line):
                values[name] = value.strip('"')
        return re.sub(r"\$(\w+)", lambda m: values.get(m.group(1), m.group(0)), self.text)


@dataclass
class Block:
    doc: str
    line: int
    commands: list[Command]
    body: str

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def fences(doc: str) -> list[tuple[str, int, str]]:
    """(language, line of the opening fence, dedented body) of every fenced block of `doc`, in list items too."""
    out, lang, start, body = [], None, 0, []
    for number, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        if lang is None and line.strip().startswith("```"):
            lang, start, body = line.strip()[3:].strip(), number, []
        elif lang is not None and line.strip() == "```":
            out.append((lang, start, textwrap.dedent("\n".join(body) + "\n")))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def blocks(doc: str) -> list[Block]:
    return [Block(doc, start, split(body, start + 1), body) for lang, start, body in fences(doc) if lang == "bash"]


def split(body: str, first_line: int) -> list[Command]:
    """Logical lines -> commands. A run of `#` lines ended by a blank line or the block's end is the output of
    the command before it; one followed directly by a command introduces that command (a heading)."""
    commands, prefix, logical, at, pending = [], [], "", None, []
    last = None
    for i, raw in enumerate(body.splitlines() + [""]):
        if not logical:
            at = first_line + i
        logical += raw.rstrip()[:-1] + " " if raw.rstrip().endswith("\\") else raw
        if raw.rstrip().endswith("\\"):
            continue
        line, logical = logical.strip(), ""
        if line.startswith("#!"):
            continue
        if line.startswith("#"):
            pending.append(line[1:].strip())
            continue
        if not line:
            if last is not None:
                last.quoted += pending
            pending = []
            continue
        pending = []
        if ASSIGNMENTS.match(line):
            prefix.append(line)
            last = None
        else:
            last = Command(line, at, list(prefix))
            commands.append(last)
    return commands


def rule(command: Command, block: Block) -> tuple[str, str]:
    """('not here', reason) | ('as written', '') | ('sandbox', ''). NOT_HERE keys match the command or,
    for scripts (`#SBATCH`), the whole block."""
    text = command.expanded()
    for key, reason in NOT_HERE.items():
        if key in command.text or key in text or (key.startswith("#") and key in block.body):
            return "not here", reason
    if PLANNER.match(text) and not READS_SANDBOX.search(text):
        return "as written", ""
    return "sandbox", ""


def substitute(text: str, port: int, procs: int = MAX_PROCS) -> str:
    """More processes than `procs` (at most MAX_PROCS: doc_runs.processes, the fewest the command's layout
    holds) become `procs`; clip sizes given in pixels (`--buckets 49x480x720,...`) become the tiny preset's
    (`--buckets preset`); a launcher gets a free rendezvous port (the default, 29500, is shared with every other
    job on this machine)."""
    text = PROCS.sub(lambda m: f"{m.group(1)}{m.group(2)}{min(int(m.group(3)), procs, MAX_PROCS)}", text)
    text = re.sub(r"--buckets \d+x\d+x\d+(,\d+x\d+x\d+)*", "--buckets preset", text)    # the tiny preset's sizes
    return re.sub(r"^(deepspeed|torchrun) ", rf"\1 --master_port {port} ", text)


DECIMAL = re.compile(r"\d+\.\d+")


def within_last_digit(quoted: str, printed: str) -> bool:
    """Two decimals equal but for one unit of the quoted one's last digit: what a training run prints (a bf16 or
    several-rank loss) rounds differently on another CPU (a quoted t100=0.9938 printed 0.9937 on the next
    machine); the planners' arithmetic has no such slack and is compared exactly."""
    return abs(float(quoted) - float(printed)) <= 1.01 * 10 ** -len(quoted.split(".")[1])


def matches(quoted: str, output: str, last_digit: bool = False) -> bool:
    """A quoted output line is in the output; `...` stands for anything. last_digit: its decimals may differ by
    one unit of their last digit (within_last_digit)."""
    if not last_digit:
        parts = [r"\s+".join(map(re.escape, p.split())) for p in quoted.split("...")]
        return re.search(r".*?".join(p for p in parts if p), output) is not None
    numbers = DECIMAL.findall(quoted)
    parts = [r"\s+".join(r"(\d+\.\d+)".join(map(re.escape, DECIMAL.split(w))) for w in p.split())
             for p in quoted.split("...")]
    pattern = re.compile(r".*?".join(p for p in parts if p))
    return any(all(within_last_digit(q, m) for q, m in zip(numbers, found.groups()))
               for found in pattern.finditer(output))


def output_blocks(doc: str) -> list[tuple[int, list[str]]]:
    """Untagged fenced blocks: a command's output, quoted. (line of the fence, its lines)."""
    return [(start, body.splitlines()) for lang, start, body in fences(doc) if not lang]
