"""The public API's documentation: every public function has a complete
numpydoc docstring whose examples run, and its annotations pass mypy."""
import doctest
import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import lnfast

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = ["lnfast._layer_norm", "lnfast._rms_norm", "lnfast._threads", "lnfast._config",
           "lnfast._kernels"]
PUBLIC = [name for name in lnfast.__all__ if callable(getattr(lnfast, name))]


@pytest.mark.parametrize("module", MODULES)
def test_examples_run(module):
    result = doctest.testmod(importlib.import_module(module),
                             optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def sections(doc):
    """numpydoc sections: {title: body}."""
    parts = re.split(r"\n\s*([A-Z][A-Za-z ]+)\n\s*-{3,}\n", doc)
    return {parts[k]: parts[k + 1] for k in range(1, len(parts) - 1, 2)}


@pytest.mark.parametrize("name", PUBLIC)
def test_complete_docstring(name):
    fn = getattr(lnfast, name)
    doc = inspect.getdoc(fn)
    assert doc and not re.search(r"\{[a-z]+\}", doc), f"{name}: no docstring, or a placeholder"
    found = sections(doc)
    assert "Examples" in found and ">>>" in found["Examples"], f"{name}: no example"
    try:
        params = [p for p in inspect.signature(fn).parameters if p not in ("self",)]
    except (TypeError, ValueError):     # (a compiled function without a signature)
        params = []
    if params:
        assert "Parameters" in found, f"{name}: no Parameters section"
        listed = re.findall(r"^(\w+(?:, \w+)*) :", found["Parameters"], re.M)
        names = {n for group in listed for n in group.split(", ")}
        assert set(params) <= names, f"{name}: undocumented {set(params) - names}"
    if inspect.signature(fn).return_annotation not in (None, "None", inspect.Signature.empty):
        assert "Returns" in found, f"{name}: no Returns section"


def test_public_annotations_pass_mypy():
    pytest.importorskip("mypy")
    p = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/numpy.md"])
def test_guide_code_runs(page):
    # every NumPy code block of the page, in order, in one namespace
    text = (ROOT / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    blocks = [b for b in blocks if "torch" not in b and "jax" not in b and "dask" not in b]
    assert blocks, page
    namespace = {}
    for block in blocks:
        exec(compile(block, page, "exec"), namespace)


def test_site_builds_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    pytest.importorskip("numpydoc")
    p = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        str(ROOT / "docs"), str(tmp_path / "html")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "html" / "reference.html").read_text().count("layer_norm_backward") > 2


@pytest.mark.parametrize("module, names", [
    ("lnfast.torch", ["layer_norm", "rms_norm", "add_layer_norm", "LayerNorm", "RMSNorm",
                      "replace_norms"]),
    ("lnfast.jax", ["layer_norm", "rms_norm", "add_layer_norm"]),
])
def test_framework_docstrings(module, names):
    # (where the framework is installed) complete docstrings whose examples run
    framework = module.split(".")[1]
    pytest.importorskip(framework)
    mod = importlib.import_module(module)
    for name in names:
        found = sections(inspect.getdoc(getattr(mod, name)))
        assert "Examples" in found, f"{module}.{name}: no example"
        if not inspect.isclass(getattr(mod, name)):
            assert {"Parameters", "Returns"} <= set(found), f"{module}.{name}"
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
