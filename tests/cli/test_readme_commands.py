"""Every command block of README.md and docs/*.md runs, and every figure they quote is what its command prints.

The blocks are read from the files (```bash fences, tests/cli/doc_blocks.py), so a new block is run without
touching this file. How each command runs, in short (the rules in full: tests/cli/doc_blocks.py):
  - planner commands (`parallel.plan`, `parallel.check`) as written, with the real presets, in-process (runpy);
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

import re

import pytest

from tests.cli import doc_blocks
from tests.cli.doc_blocks import DOCS, blocks, matches, rule
from tests.cli.doc_runs import check_figure, figures, needs_sandbox, run_doc

# The programs a documented command may start with; another one fails test_every_command_has_a_rule.
PROGRAMS = re.compile(r"^(python -m (parallel\.\w+|bench|models)|deepspeed|torchrun|cp|bash scripts/\w+\.sh|"
                      r"\./launch\.sh|pip|echo)\b")


@pytest.fixture(scope="session")
def sandbox_base(tmp_path_factory):
    from tests.cli.doc_sandbox import build
    return build(tmp_path_factory.mktemp("doc-sandbox"))


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



# The figures of commands run in the sandbox; the others are test_doc_figures.py's and test_doc_parameter_counts.py's
# (another xdist worker's meanwhile), and so is every output block (no documented one needs the sandbox).
@pytest.mark.docs
@pytest.mark.parametrize("doc, pattern, source, extract", figures(needs_sandbox))
def test_quoted_figures_are_what_the_commands_print(doc, pattern, source, extract, sandbox_base):
    check_figure(doc, pattern, source, extract, lambda: sandbox_base)
