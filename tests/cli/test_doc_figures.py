"""The figures the docs quote from the planner's commands, and every output block, each what its command prints when
run as written from the repository root (tests/cli/doc_runs.py: FIGURES, OUTPUT_OF). A module of its own so that a
pytest-xdist worker runs it while another runs the documents' commands (tests/cli/test_readme_commands.py)."""
import pytest

from tests.cli.doc_runs import check_figure, check_output_block, figures, is_parameter_count, needs_sandbox, \
    output_block_params


def as_written(source: str) -> bool:
    return not needs_sandbox(source) and not is_parameter_count(source)


def no_sandbox():
    raise AssertionError("a figure of the planner's commands needs no sandbox")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """The sandbox (tests/cli/doc_sandbox.py), built on first use. Every output block the docs hold today is a command
    run as written, so none builds it; a block of a command run in the sandbox is checked here all the same, at the
    cost of building it and running its document in this worker too."""
    built = []

    def base():
        if not built:
            from tests.cli.doc_sandbox import build
            built.append(build(tmp_path_factory.mktemp("doc-sandbox")))
        return built[0]
    return base


@pytest.mark.docs
@pytest.mark.parametrize("doc, pattern, source, extract", figures(as_written))
def test_quoted_figures_are_what_the_commands_print(doc, pattern, source, extract):
    check_figure(doc, pattern, source, extract, no_sandbox)


@pytest.mark.docs
@pytest.mark.parametrize("doc, line, lines", output_block_params(lambda source: True))
def test_output_blocks_are_what_the_commands_print(doc, line, lines, sandbox):
    check_output_block(doc, line, lines, sandbox)
