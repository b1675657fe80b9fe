"""The installed package: typing marker and extension stub present, the stub in step with the extension,
test hooks outside the API, one version everywhere."""

import ast
import os
import re
import subprocess

import pytest

import gdnkit
from gdnkit import _gdnkit, _testing

PKG = os.path.dirname(gdnkit.__file__)


def stub_tree():
    with open(os.path.join(PKG, "_gdnkit.pyi"), encoding="utf-8") as f:
        return ast.parse(f.read())


def stub_functions():
    return {n.name: n for n in stub_tree().body if isinstance(n, ast.FunctionDef)}


def top_level_split(params):
    """Splits a parameter list at the commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in params:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def extension_params(fn):
    """(names before '*', names after '*') from nanobind's signature of fn."""
    sig = fn.__nb_signature__[0][0]
    inner = sig[sig.index("(") + 1:sig.rindex(") ->")]
    before, after, star = [], [], False
    for part in top_level_split(inner):
        if part == "*":
            star = True
            continue
        (after if star else before).append(part.split(":")[0].split("=")[0].strip())
    return before, after


def test_typing_files_installed():
    assert os.path.isfile(os.path.join(PKG, "py.typed"))
    assert os.path.isfile(os.path.join(PKG, "_gdnkit.pyi"))


def test_stub_declares_the_extension():
    declared = set(stub_functions())
    for node in stub_tree().body:
        if isinstance(node, ast.ClassDef):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    assert "__version__" in declared
    declared.discard("__version__")
    names = {n for n in dir(_gdnkit) if not n.startswith("__")}
    assert names == declared


@pytest.mark.parametrize("name", sorted(stub_functions()))
def test_stub_signatures(name):
    fn = getattr(_gdnkit, name)
    if not hasattr(fn, "__nb_signature__"):
        pytest.skip("this nanobind does not expose __nb_signature__")
    node = stub_functions()[name]
    stub = ([a.arg for a in node.args.posonlyargs + node.args.args], [a.arg for a in node.args.kwonlyargs])
    assert extension_params(fn) == stub


def test_exception_types_match_the_stub():
    for cls, base in [(gdnkit.GdnkitError, ValueError), (gdnkit.GdnkitNotImplementedError, NotImplementedError),
                      (gdnkit.GdnkitRuntimeError, RuntimeError)]:
        assert cls.__bases__ == (base,)


def test_test_hooks_outside_the_api():
    assert "_testing" not in gdnkit.__all__
    assert [n for n in dir(_gdnkit._testing) if not n.startswith("__")] == ["raise_error"]
    with pytest.raises(gdnkit.GdnkitError, match=r"^mode: expected 0, 1, 2 or 3, got 7$"):
        _testing.raise_error(7)


# ---- the version: include/gdnkit/version.h is its one source -----------------------------------------

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VERSION_H = os.path.join(REPO, "include", "gdnkit", "version.h")


def header_version():
    with open(VERSION_H, encoding="utf-8") as f:
        text = f.read()
    parts = [re.search(rf"^#define GDNKIT_VERSION_{p} (\d+)$", text, re.M) for p in ("MAJOR", "MINOR", "PATCH")]
    assert all(parts), f"{VERSION_H}: no GDNKIT_VERSION_MAJOR/MINOR/PATCH lines"
    return ".".join(m.group(1) for m in parts)


def test_version_is_the_compiled_one():
    assert re.fullmatch(r"\d+\.\d+\.\d+", gdnkit.__version__)
    assert gdnkit.__version__ == _gdnkit.__version__
    assert gdnkit.build_info().splitlines()[0] == f"gdnkit {gdnkit.__version__}"


@pytest.mark.skipif(not os.path.isfile(VERSION_H), reason="not run from the repository (no include/gdnkit/version.h)")
def test_version_matches_the_header():
    assert gdnkit.__version__ == header_version()


@pytest.mark.skipif(not os.path.isfile(os.path.join(REPO, "pyproject.toml")), reason="not run from the repository")
def test_pyproject_reads_the_version_from_the_header():
    """pyproject.toml has no version of its own: scikit-build-core's regex provider reads version.h (run here
    the way the provider runs it: re.search with MULTILINE, then result.format of the groups)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert "version" not in meta["project"]
    assert "version" in meta["project"]["dynamic"]
    provider = meta["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["provider"] == "scikit_build_core.metadata.regex"
    assert os.path.normpath(os.path.join(REPO, provider["input"])) == VERSION_H
    with open(VERSION_H, encoding="utf-8") as f:
        m = re.search(provider["regex"], f.read(), re.MULTILINE)
    assert m, "the provider's regex does not match include/gdnkit/version.h"
    assert provider["result"].format(*m.groups(), **m.groupdict()) == gdnkit.__version__


def test_installed_metadata_version():
    """The wheel's metadata (when gdnkit was installed by pip, not imported from the source tree)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("gdnkit")
    except metadata.PackageNotFoundError:
        pytest.skip("gdnkit has no installed metadata (imported from the source tree)")
    if os.path.realpath(str(dist.locate_file("gdnkit/__init__.py"))) != os.path.realpath(gdnkit.__file__):
        pytest.skip("the installed gdnkit metadata belongs to another copy than the one imported")
    assert dist.version == gdnkit.__version__
    assert dist.metadata["License-Expression"] == "Apache-2.0"
    assert "torch" in (dist.metadata.get_all("Provides-Extra") or [])


@pytest.mark.skipif(not os.environ.get("GDNKIT_CLI"), reason="GDNKIT_CLI (a built gdnkit command-line tool) not set")
def test_cli_version():
    """tools/test.sh sets GDNKIT_CLI to the CLI of its C++ build."""
    out = subprocess.run([os.environ["GDNKIT_CLI"], "--version"], capture_output=True, text=True, check=True).stdout
    assert out == f"gdnkit {gdnkit.__version__}\n"
