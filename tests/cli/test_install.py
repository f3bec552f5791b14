"""The package as `pip install` leaves it: a wheel built from a copy of the tree, installed into a scratch folder,
runs from /tmp with presets and DeepSpeed JSONs found through the package; the console scripts are the commands."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("pyproject.toml", "README.md", "parallel", "models", "configs", "ds_configs")


def scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, str]:
    """(site folder, the build's output): the wheel of a copy of the tree (setuptools writes build/ and
    *.egg-info beside the sources), installed with --target."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in SHIPPED:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                        if (ROOT / name).is_dir() else {}))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel, = (tmp / "wheel").glob("*.whl")
    site = tmp / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return site, build.stdout + build.stderr


def run_installed(site: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python -c` from /tmp with only the installed copy of the toolkit importable (and the venv's packages)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *argv], cwd="/tmp", env=env, capture_output=True, text=True, timeout=300)


def test_presets_and_ds_configs_are_found_through_the_installed_package(installed):
    site, _ = installed
    code = ("import sys, parallel; from parallel.check import main; "
            f"assert parallel.__file__.startswith({str(site)!r}), parallel.__file__; "
            "sys.exit(main(sys.argv[1:]))")
    proc = run_installed(site, "-c", code, "--config", "cogvideox-5b", "--deepspeed_config", "zero1_bf16",
                         "--world-size", "8", "--set", "parallel.tp_size=2", "--no-device-check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok: cogvideox-5b tp=2 pp=1 dp=4 (world 8), ZeRO-1 bf16, global batch 4")
    # The shipped path as the docs spell it works from anywhere too.
    proc = run_installed(site, "-c", code, "--config", "configs/cogvideox-2b.yaml", "--deepspeed_config",
                         "ds_configs/zero2_bf16.json", "--world-size", "2", "--no-device-check")
    assert proc.returncode == 0 and proc.stdout.startswith("ok: cogvideox-2b tp=1 pp=1 dp=2 (world 2), ZeRO-2 bf16")


def test_setuptools_takes_the_metadata_without_warnings(installed):
    """license as an SPDX string: the TOML table form printed 52 lines of deprecation warnings per install."""
    site, output = installed
    assert "Warning" not in output and "deprecated" not in output, output[-3000:]
    metadata = (site / next(site.glob("*.dist-info")).name / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata


def test_every_console_script_is_installed_and_names_its_command(installed):
    """Each entry point of the wheel imports and prints its command's usage (python -m <module>)."""
    site, _ = installed
    entry = (site / next(site.glob("*.dist-info")).name / "entry_points.txt").read_text()
    for name, target in scripts().items():
        assert f"{name} = {target}" in entry
        module, func = target.split(":")
        proc = run_installed(site, "-c", f"import sys; sys.argv[0] = {name!r}; from {module} import {func}; "
                             f"sys.exit({func}(['--help']))")
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        command = "parallel.plan" if module == "parallel.plan.cli" else \
            "parallel.prepare_data" if module == "parallel.prepare_data.prepare" else module
        assert proc.stdout.startswith(f"usage: python -m {command} "), (name, proc.stdout[:200])


def test_the_venvs_console_script_runs_from_tmp():
    """vdp-check as installed in this environment (an editable install), run from /tmp with a preset name."""
    script = Path(sys.executable).parent / "vdp-check"
    if not script.exists():
        pytest.skip(f"{script}: the environment has no console scripts (pip install -e .)")
    proc = subprocess.run([str(script), "--config", "cogvideox-5b", "--deepspeed_config", "zero1_bf16",
                           "--world-size", "8", "--set", "parallel.tp_size=2", "--no-device-check"],
                          cwd="/tmp", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok: cogvideox-5b tp=2 pp=1 dp=4 (world 8), ZeRO-1 bf16")


@pytest.mark.parametrize("inherited, want", [
    ({}, "{venv}/torch_extensions"),
    # what another checkout's env.sh exported (the docs' sandbox under scripts/test.sh): not inherited
    ({"TORCH_EXTENSIONS_DIR": "/other/.venv/torch_extensions", "VDP_ENV_EXTENSIONS": "/other/.venv/torch_extensions"},
     "{venv}/torch_extensions"),
    ({"TORCH_EXTENSIONS_DIR": "/scratch/ext"}, "/scratch/ext"),           # the user's own: kept
])
def test_env_sh_gives_each_environment_its_own_extensions_folder(inherited, want, tmp_path):
    """scripts/env.sh on an environment already set up (its stamp present: nothing installed): the folder DeepSpeed
    JIT-builds its ops in. A shared one is rebuilt by each environment in turn (the build commands name the
    environment's paths); two test workers in two environments raced for it."""
    import hashlib

    venv = tmp_path / "venv"
    venv.mkdir()
    digest = hashlib.sha1((ROOT / "pyproject.toml").read_bytes() + (ROOT / "scripts/env.sh").read_bytes()).hexdigest()
    (venv / f".installed-{digest[:12]}").touch()
    env = {"PATH": os.environ["PATH"], "VDP_VENV": str(venv), **inherited}
    out = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/env.sh && echo $TORCH_EXTENSIONS_DIR"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want.format(venv=venv)
