"""``scripts/install_gpu.sh --te-only`` run here against a local index of FAKE Transformer Engine distributions (the
CPU machine has no CUDA and no network): the real script, the real pip, a throw-away environment that sees this
repository's torch and Megatron-Core. The environment starts half-installed (only the core library, whose import
raises "Could not find `transformer-engine`", so ``import megatron.core`` crashes, as after the old recipe); the
fake torch binding fails to build (or builds but does not import). The script must leave no TE piece behind and an
environment where ``import megatron.core`` works, after giving the build what it needs: no build isolation (the
environment's torch), NVTE_PYTORCH_FORCE_BUILD=TRUE, nvcc's toolkit as CUDA_HOME, the cuDNN and NCCL headers of the
environment's nvidia packages on CPLUS_INCLUDE_PATH. The successful build cannot run here (it needs nvcc and a
GPU); the device check covers what a GPU machine can."""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = "2.11.0"
NO_META_PACKAGE = 'raise AssertionError("Could not find `transformer-engine`.")\n'


def _wheel(folder: Path, name: str, files: dict[str, str], requires: list[str] = (), extras=()) -> None:
    """A minimal valid wheel ``name``-VERSION-py3-none-any.whl in ``folder``."""
    info = f"{name}-{VERSION}.dist-info"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {VERSION}"]
    meta += [f"Provides-Extra: {e}" for e in extras] + [f"Requires-Dist: {r}" for r in requires]
    files = {**files, f"{info}/METADATA": "\n".join(meta) + "\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    with zipfile.ZipFile(folder / f"{name}-{VERSION}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
        whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")


BINDING_SETUP = '''
import json, os, sys
from setuptools import setup

if "bdist_wheel" in sys.argv:  # the build, after pip read the metadata: record what it was given
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    keys = ("NVTE_PYTORCH_FORCE_BUILD", "CUDA_HOME", "CPLUS_INCLUDE_PATH", "PATH")
    record = {k: os.environ.get(k) for k in keys}
    record["torch"] = torch_version
    with open(os.environ["FAKE_TE_RECORD"], "w") as f:
        json.dump(record, f)
    if os.environ.get("FAKE_TE_BUILD") != "ok":
        raise RuntimeError("nvcc fatal: simulated compile error in the fake transformer_engine_torch")
setup(name="transformer_engine_torch", version="%s", py_modules=["transformer_engine_torch"],
      install_requires=["transformer_engine_cu13==%s"])
''' % (VERSION, VERSION)


def _sdist(folder: Path) -> None:
    base = f"transformer_engine_torch-{VERSION}"
    files = {"setup.py": BINDING_SETUP, "transformer_engine_torch.py": "",
             "pyproject.toml": '[build-system]\nrequires = ["setuptools"]\n'
                               'build-backend = "setuptools.build_meta:__legacy__"\n',
             "PKG-INFO": f"Metadata-Version: 2.1\nName: transformer_engine_torch\nVersion: {VERSION}\n"}
    with tarfile.open(folder / f"{base}.tar.gz", "w:gz") as tar:
        for path, text in files.items():
            data = text.encode()
            entry = tarfile.TarInfo(f"{base}/{path}")
            entry.size = len(data)
            tar.addfile(entry, io.BytesIO(data))


def _index(folder: Path, pytorch_init: str) -> Path:
    """The fake release: transformer-engine (extras core_cu13, pytorch), transformer-engine-cu13 (whose package
    raises as TE 2.11's does without the transformer-engine package), transformer-engine-torch (an sdist)."""
    folder.mkdir()
    _wheel(folder, "transformer_engine", {"transformer_engine/__init__.py": "",
                                          "transformer_engine/pytorch/__init__.py": pytorch_init},
           requires=[f'transformer_engine_cu13=={VERSION}; extra == "core_cu13"',
                     f'transformer_engine_torch=={VERSION}; extra == "pytorch"'], extras=("core_cu13", "pytorch"))
    _wheel(folder, "transformer_engine_cu13", {"transformer_engine/__init__.py": NO_META_PACKAGE})
    _sdist(folder)
    return folder


@pytest.fixture()
def env_with_half_te(tmp_path):
    """A throw-away environment (venv without pip) that sees this repository's .venv (torch, Megatron-Core, pip,
    setuptools), with the TE core library alone installed, fake cuDNN/NCCL headers under nvidia/ and an nvcc on
    PATH; returns (python, environment variables for the script)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    base = sysconfig.get_paths()["purelib"]  # this repository's environment, with its .pth files
    tools = tmp_path / "tools"  # TE's setup.py imports wheel.bdist_wheel: setuptools' own copy of `wheel`
    tools.mkdir()
    (tools / "wheel").symlink_to(Path(base) / "setuptools" / "_vendor" / "wheel")
    (site / "zz_base.pth").write_text(f"import site; site.addsitedir({base!r})\n{tools}\n")
    for header in ("cudnn/include/cudnn.h", "nccl/include/nccl.h"):
        (site / "nvidia" / header).parent.mkdir(parents=True)
        (site / "nvidia" / header).write_text("")
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CPLUS_INCLUDE_PATH", "PYTHONPATH")}
    env.update(PYTHON=str(python), PATH=f"{toolkit / 'bin'}{os.pathsep}{env['PATH']}", PIP_CONFIG_FILE=os.devnull,
               PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_CONSTRAINT="",
               FAKE_TE_RECORD=str(tmp_path / "build.json"), INSTALL_GPU_LOG=str(tmp_path / "te.log"))
    return python, env, site, toolkit


def _run(python, *args, env, timeout=600):
    return subprocess.run([str(python), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _te_pieces(python, env) -> list[str]:
    listing = _run(python, "-m", "pip", "list", "--format=json", "--path",
                   _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                        env=env).stdout.strip(), env=env)
    return sorted(p["name"] for p in json.loads(listing.stdout) if p["name"].lower().startswith("transformer"))


def _install_script(env, *args):
    return subprocess.run(["bash", str(REPO / "scripts" / "install_gpu.sh"), "--te-only", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def _half_install(python, env, index):
    proc = _run(python, "-m", "pip", "install", "--find-links", str(index), f"transformer_engine_cu13=={VERSION}",
                env=env)
    assert proc.returncode == 0, proc.stderr
    assert _te_pieces(python, env) == ["transformer_engine_cu13"]
    crash = _run(python, "-c", "import megatron.core", env=env)  # the state the old recipe left
    assert crash.returncode != 0 and "Could not find `transformer-engine`" in crash.stderr


def test_failed_te_build_leaves_no_te_piece_and_megatron_imports(tmp_path, env_with_half_te):
    python, env, site, toolkit = env_with_half_te
    index = _index(tmp_path / "index", "import transformer_engine_torch\n")
    _half_install(python, env, index)
    env["PIP_FIND_LINKS"] = str(index)
    proc = _install_script(env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out  # the TE-free environment works: exit 0 (--require-te: 1, test below)
    assert "the Transformer Engine build failed" in out and "Transformer Engine was NOT installed" in out
    assert "uninstalling every Transformer Engine piece: transformer-engine-cu13" in out
    assert "simulated compile error" in (tmp_path / "te.log").read_text()
    assert _te_pieces(python, env) == []
    assert _run(python, "-c", "import megatron.core", env=env).returncode == 0
    build = json.loads((tmp_path / "build.json").read_text())  # what the (failed) build was given
    assert build["torch"] is not None  # no build isolation: it saw the environment's torch
    assert build["NVTE_PYTORCH_FORCE_BUILD"] == "TRUE" and build["CUDA_HOME"] == str(toolkit)
    assert build["CPLUS_INCLUDE_PATH"].split(":")[:2] == [str(site / "nvidia" / "nccl" / "include"),
                                                          str(site / "nvidia" / "cudnn" / "include")]


@pytest.mark.slow
def test_te_that_builds_but_does_not_import_is_removed(tmp_path, env_with_half_te):
    python, env, _, _ = env_with_half_te
    no_binding = 'raise FileNotFoundError("Could not find shared object file for Transformer Engine torch lib.")\n'
    index = _index(tmp_path / "index", no_binding)
    env.update(PIP_FIND_LINKS=str(index), FAKE_TE_BUILD="ok")
    proc = _install_script(env, "--require-te")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # --require-te: a TE that could not be installed is the exit status
    assert "Transformer Engine was installed but does not import" in out
    assert "uninstalling every Transformer Engine piece: transformer-engine transformer-engine-torch " \
           "transformer-engine-cu13" in out
    assert _te_pieces(python, env) == []
    assert _run(python, "-c", "import megatron.core", env=env).returncode == 0


def test_transformer_engine_is_pinned_whole_in_one_place():
    """The old recipe's defect: requirements/gpu.txt and the `gpu` extra pinned transformer-engine-cu13 (the core
    library) without the transformer-engine package, a TE that breaks `import megatron.core`. TE is pinned only in
    requirements/gpu-te.txt, as transformer-engine[core_cuNN]==V, which scripts/install_gpu.sh completes with the
    torch binding of the same version (or removes)."""
    import ast
    import re

    te = re.compile(r"^\s*transformer[-_.]engine", re.I)
    for path in sorted((REPO / "requirements").glob("*.txt")):
        pins = [line for line in path.read_text().splitlines() if te.match(line)]
        if path.name == "gpu-te.txt":
            assert len(pins) == 1 and re.fullmatch(r"transformer-engine\[core_cu1[23]\]==\d+\.\d+\.\d+", pins[0])
        else:
            assert pins == [], f"{path.name} pins part of Transformer Engine: {pins}"
    setup = ast.parse((REPO / "setup.py").read_text())
    extras = next(kw.value for node in ast.walk(setup) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    requirements = [r for values in ast.literal_eval(extras).values() for r in values]
    assert not [r for r in requirements if te.match(r)], requirements
