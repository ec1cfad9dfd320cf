"""The training corpus: permissively licensed Python sources found on the machine.

Sources, in this order:
  stdlib   the Python standard library of the running interpreter (PSF licence), *.py;
  libs     a few site-packages whose distribution metadata names a permissive licence
           (BSD / MIT / Apache / PSF), *.py, capped per package.

Files are read in sorted path order and split by FILE into train / held-out: a file is held
out when sha1("<source>:<relative path>") mod 1000 < eval_permille. Held-out files never
reach training; a capped, deterministic subset of them becomes the eval text of a domain:

  stdlib_code    held-out stdlib files outside test/
  stdlib_tests   held-out stdlib files under test/ (when the stdlib ships its test suite)
  libs_code      held-out files of the extra packages
  docstrings     module/class/function docstrings of held-out stdlib files (English prose)

A domain's eval text is its documents joined by the end-of-text token's literal string, the
same separator the training stream uses, so the tokens of the text are what was evaluated.
"""

import ast
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass, field
from importlib import metadata

# Packages tried for the "libs" source, in this order; each is used only if installed and its
# metadata names a permissive licence (checked at run time and recorded in train_log.json).
EXTRA_PACKAGES = ("sympy", "networkx", "numpy", "scipy", "pandas", "sklearn")
PERMISSIVE = re.compile(r"\b(BSD|MIT|Apache|PSF|Python Software Foundation)\b", re.I)
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


@dataclass
class Doc:
    source: str      # "stdlib" or the package name
    relpath: str
    text: str
    held_out: bool


@dataclass
class Corpus:
    train: list = field(default_factory=list)     # list[Doc]
    held_out: list = field(default_factory=list)  # list[Doc]
    licences: dict = field(default_factory=dict)  # source -> licence string
    roots: dict = field(default_factory=dict)     # source -> directory


def is_held_out(source, relpath, eval_permille):
    h = int(hashlib.sha1(f"{source}:{relpath}".encode()).hexdigest(), 16)
    return h % 1000 < eval_permille


def read_text(path, max_bytes):
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError:
        return None
    if len(raw) > max_bytes or b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def walk_py(root):
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for fn in sorted(files):
            if fn.endswith(".py"):
                out.append(os.path.join(d, fn))
    return sorted(out)


def package_licence(pkg):
    """Licence string from the distribution providing top-level package `pkg`, or None."""
    dists = metadata.packages_distributions().get(pkg, [])
    for dist in dists:
        try:
            md = metadata.metadata(dist)
        except metadata.PackageNotFoundError:
            continue
        parts = [md.get("License-Expression") or "", (md.get("License") or "")[:200]]
        parts += [c for c in md.get_all("Classifier") or [] if c.startswith("License ::")]
        text = " | ".join(p for p in parts if p)
        if PERMISSIVE.search(text):
            return f"{dist}: {text}"
    return None


def collect(eval_permille, max_file_bytes, extra_packages, per_package_bytes, forbidden):
    """All documents, train and held-out, in deterministic order."""
    c = Corpus()
    stdlib = sysconfig.get_paths()["stdlib"]
    c.roots["stdlib"] = stdlib
    c.licences["stdlib"] = "Python Software Foundation License (Python standard library)"
    sources = [("stdlib", stdlib, None)]
    for pkg in extra_packages:
        try:
            spec_root = _package_root(pkg)
        except Exception:  # noqa: BLE001 (not installed / broken: skipped, recorded)
            spec_root = None
        lic = package_licence(pkg) if spec_root else None
        if spec_root and lic:
            sources.append((pkg, spec_root, per_package_bytes))
            c.roots[pkg] = spec_root
            c.licences[pkg] = lic
    for source, root, cap in sources:
        used = 0
        for path in walk_py(root):
            text = read_text(path, max_file_bytes)
            if not text or not text.strip() or any(t in text for t in forbidden):
                continue
            if cap is not None and used + len(text) > cap:
                continue
            used += len(text)
            rel = os.path.relpath(path, root)
            doc = Doc(source, rel, text, is_held_out(source, rel, eval_permille))
            (c.held_out if doc.held_out else c.train).append(doc)
    return c


def _package_root(pkg):
    import importlib.util
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        return None
    return sorted(spec.submodule_search_locations)[0]


def docstrings(text):
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node, clean=True)
            if d and len(d) >= 40:
                out.append(d)
    return out


def _take(docs, cap):
    """Whole documents in order until `cap` characters; the one that overflows is cut at a line."""
    out, used = [], 0
    for d in docs:
        if used >= cap:
            break
        if used + len(d) > cap:
            cut = d[: cap - used]
            cut = cut[: cut.rfind("\n") + 1] if "\n" in cut else cut
            if len(cut) >= 200:
                out.append(cut)
            break
        out.append(d)
        used += len(d)
    return out


def eval_domains(corpus, chars_per_domain):
    """{domain: [document texts]} from the held-out files (deterministic order: by hash)."""
    def key(d):
        return hashlib.sha1(f"{d.source}:{d.relpath}".encode()).hexdigest()

    held = sorted(corpus.held_out, key=key)
    std = [d for d in held if d.source == "stdlib"]
    groups = {
        "stdlib_code": [d.text for d in std if not _is_test(d.relpath)],
        "stdlib_tests": [d.text for d in std if _is_test(d.relpath)],
        "libs_code": [d.text for d in held if d.source != "stdlib"],
        "docstrings": [s for d in std if not _is_test(d.relpath) for s in docstrings(d.text)],
    }
    return {k: _take(v, chars_per_domain) for k, v in groups.items() if v}


def _is_test(relpath):
    parts = relpath.split(os.sep)
    return parts[0] in ("test", "tests") or "tests" in parts
