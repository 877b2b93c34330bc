"""Sphinx configuration: the user's manual (`sphinx-build -W docs html`).

Pages are Markdown (MyST); the API reference is generated from the
numpydoc docstrings of the installed (or built in place) package."""
import pathlib
import sys

# The source tree when it is built in place (setup.py build_ext --inplace),
# else the installed package.
_SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
if any((_SRC / "lnfast").glob("_cpu*.so")) or any((_SRC / "lnfast").glob("_cpu*.pyd")):
    sys.path.insert(0, str(_SRC))

# The frameworks' reference pages, where the framework imports.
_OPTIONAL = {"reference_torch.md": "lnfast.torch", "reference_jax.md": "lnfast.jax"}


def _importable(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False


project = "lnfast"
author = "the lnfast developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "numpydoc"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"] + [
    page for page, module in _OPTIONAL.items() if not _importable(module)]
myst_heading_anchors = 3
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
autodoc_typehints = "none"          # (the docstrings say the types)
html_theme = "alabaster"
html_title = "lnfast"
# Pages link to the project's files (README, tests, sources) by relative
# path, which the site has no page for.
suppress_warnings = ["myst.xref_missing"]
