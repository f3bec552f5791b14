"""README.md's preset table: each preset's parameter count is what `python -m models --config <preset>` prints
(tests/cli/doc_runs.py: FIGURES). A module of its own so that a pytest-xdist worker runs it while another runs the
documents' commands (tests/cli/test_readme_commands.py)."""
import pytest

from tests.cli.doc_runs import check_figure, figures, is_parameter_count


def no_sandbox():
    raise AssertionError("python -m models needs no sandbox")


@pytest.mark.docs
@pytest.mark.parametrize("doc, pattern, source, extract", figures(is_parameter_count))
def test_each_presets_parameter_count_is_what_python_m_models_prints(doc, pattern, source, extract):
    check_figure(doc, pattern, source, extract, no_sandbox)
