"""The docs name only what exists (issue 39, item 5): every repository path, script flag, gin binding, make target,
project module attribute and test that README.md and docs/*.md name is checked against the code, and the README's
notebook times against what the committed notebooks recorded.

What counts as a name (``_names``): code spans, fenced code blocks, markdown link targets and, for paths, prose too.

- **paths**: tokens starting with a top-level folder of the repository (``fp8rl_jax/``, ``scripts/``, ``configs/``,
  ``docs/``, ``benchmarks/``, ``tests/``, ``examples/``, ``rollout_bridge/``; ``results/`` is the docs' short form of
  ``benchmarks/results/``) or a link target; ``{a,b}`` / ``{1..5}`` are expanded and ``*`` globbed; each must match
  a file or folder. Tokens with a placeholder (``<exp>``, ``...``) are skipped.
- **script flags**: ``--flag`` after ``scripts/X.py`` or ``benchmarks/X.py`` in the same command (a ``\\`` continues
  it), or a lone ``--flag`` span attributed to the script named last in the same paragraph or table row, else to any
  project script (a row naming another framework is skipped: its flags are that framework's). Flags come from each
  script's own ``--help`` (run once per script).
- **gin bindings**: ``namespace.param`` whose namespace is a registered gin configurable (after importing what
  ``scripts/train.py`` imports), every binding inside ``--gin_param=...``, and ``ns.param = ...`` lines of fenced
  blocks without a language; the namespace and the parameter must exist (``ns.*`` checks the namespace only).
- **make targets**: ``make X`` in a code span or block.
- **project attributes**: ``fp8rl_jax.a.b`` / ``rollout_bridge.a.b``: the module file exists and defines (or
  imports) the name.
- **tests**: ``tests/test_x.py::test_name``: the file defines the function.

``EXTERNAL`` is the allow-list for names that look like ours but are another project's, each with its reason.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
TOP_DIRS = ("fp8rl_jax", "scripts", "configs", "docs", "benchmarks", "tests", "examples", "rollout_bridge")

#: names in the docs that are another project's, not ours: {name as written: reason}
EXTERNAL = {
    "docs/advance/fp8.md": "verl's documentation page (its FP8 rollout report), cited as the source of the settings",
    "tests/quantization/test_blackwell_moe.py": "a vLLM test file, cited for what vLLM itself checks",
}
#: frameworks whose flags and options the docs compare ours with; a table row or line naming one is theirs
OTHER_TOOLS = ("verl", "slime", "TRL", "NeMo", "SkyRL", "prime-rl", "OpenRLHF", "vLLM", "vllm", "nvcc", "ptxas",
               "pytest", "pip", "XLA_FLAGS", "jupyter", "ray start", "DeepGEMM", "Triton", "git ")


def _read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def _split_fences(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the text with fenced blocks blanked out, [(language, body)])."""
    blocks = []

    def keep(m):
        blocks.append((m.group(1).strip(), m.group(2)))
        return "\n" * m.group(0).count("\n")

    prose = re.sub(r"^```([^\n]*)\n(.*?)^```[ \t]*$", keep, text, flags=re.S | re.M)
    return prose, blocks


def _spans(prose: str) -> list[tuple[str, int]]:
    """Inline code spans (they may wrap lines inside a paragraph) with their offset in ``prose``."""
    return [(m.group(2), m.start()) for m in re.finditer(r"(`+)((?:(?!\1)[^\n]|\n(?!\s*\n))+?)\1", prose)]


def _unit_of(prose: str, pos: int) -> str:
    """The paragraph around ``pos``; in a table, its row."""
    line_start = prose.rfind("\n", 0, pos) + 1
    line_end = prose.find("\n", pos)
    line = prose[line_start:line_end if line_end >= 0 else len(prose)]
    if line.lstrip().startswith("|"):
        return line
    start = prose.rfind("\n\n", 0, pos)
    end = prose.find("\n\n", pos)
    return prose[start + 1 if start >= 0 else 0:end if end >= 0 else len(prose)]


def _expand_braces(s: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", s)
    if not m:
        return [s]
    body = m.group(1)
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    alts = [str(i) for i in range(int(r.group(1)), int(r.group(2)) + 1)] if r else body.split(",")
    return [x for a in alts for x in _expand_braces(s[:m.start()] + a + s[m.end():])]


# ------------------------------------------------------------------------------------------------ paths

_PATH = re.compile(r"(?<![\w./@-])((?:\.\./)*(?:%s|results)/[\w.*{},/\-]*)" % "|".join(TOP_DIRS))


def _path_exists(token: str, base: str) -> bool:
    for p in _expand_braces(token):
        if glob.glob(os.path.normpath(os.path.join(base, p))):
            continue
        return False
    return True


def _path_problems(doc: str) -> list[str]:
    text = _read(doc)
    doc_dir = os.path.dirname(os.path.join(ROOT, doc))
    out = []
    candidates = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):  # markdown links: relative to the doc's folder
        target = m.group(1).split("#")[0]
        if target and not re.match(r"^[a-z]+:", target):
            candidates.append((target, doc_dir))
    for m in _PATH.finditer(text):
        tok = m.group(1).rstrip(".,;:")
        if text[m.end():m.end() + 1] in ("<", "["):
            continue  # a placeholder follows: benchmarks/results/gpu_tests_<date>.md
        if m.start() > 0 and text[m.start() - 1] == "(" and text[max(0, m.start() - 2)] == "]":
            continue  # a link target, done above
        if tok.startswith("../"):
            candidates.append((tok, doc_dir))
        elif tok.startswith("results/"):
            candidates.append(("benchmarks/" + tok, ROOT))
        else:
            candidates.append((tok, ROOT))
    for tok, base in candidates:
        tok = tok.split("::")[0]
        if tok in EXTERNAL or "<" in tok or "..." in tok or tok.endswith("/.."):
            continue
        if not _path_exists(tok, base):
            out.append(f"{doc}: path {tok}")
    return out


# ------------------------------------------------------------------------------------------------ flags

@functools.lru_cache(maxsize=None)
def _script_flags(script: str) -> frozenset[str] | None:
    """The long options ``script --help`` lists (None: the script has no argument parser)."""
    path = os.path.join(ROOT, script)
    with open(path, encoding="utf-8") as f:
        if "add_argument(" not in f.read():
            return None
    r = subprocess.run([sys.executable, path, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, f"{script} --help failed: {r.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", r.stdout))


def _project_scripts() -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for d in ("scripts", "benchmarks")
                  for p in glob.glob(os.path.join(ROOT, d, "*.py")) if not os.path.basename(p).startswith("_"))


_SCRIPT = re.compile(r"(?<![\w/])((?:scripts|benchmarks)/\w+\.py|\b\w+\.py)\b")
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")


def _script_of(name: str) -> str | None:
    if "/" in name:
        return name if os.path.isfile(os.path.join(ROOT, name)) else None
    hits = [s for s in _project_scripts() if os.path.basename(s) == name]
    return hits[0] if len(hits) == 1 else None


def _commands(text: str) -> list[str]:
    """Shell commands of a code span or block: ``\\``-continued lines joined, split at ``&&``, ``;``, ``|``."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        out += [c for c in re.split(r"&&|;|\|", line) if c.strip()]
    return out


def _flag_uses(doc: str) -> list[tuple[str, str, str]]:
    """``[(script or "*", flag, where)]``: every project-script flag the doc names."""
    prose, blocks = _split_fences(_read(doc))
    uses = []
    for body in [b for _, b in blocks] + [s.replace("\n", " ") for s, _ in _spans(prose)]:  # a span may wrap
        for cmd in _commands(body):
            parts = _SCRIPT.split(cmd)  # [before, script, after, script, after, ...]
            for i in range(1, len(parts), 2):
                script = _script_of(parts[i])
                if script is None:
                    continue
                for flag in _FLAG.findall(parts[i + 1]):
                    if not flag.startswith("--xla_"):
                        uses.append((script, flag, cmd.strip()[:100]))
    for span, pos in _spans(prose):  # a lone flag: the script named last in its paragraph / table row
        m = re.fullmatch(r"(--[A-Za-z][\w-]*)(?:[= ].*)?", span.strip(), flags=re.S)
        if not m:
            continue
        line = prose[prose.rfind("\n", 0, pos) + 1:prose.find("\n", pos)]
        if any(t in line or t in prose[max(0, pos - 80):pos] for t in OTHER_TOOLS):
            continue  # another tool's flag (the tool is named on its line or just before it)
        in_table = line.lstrip().startswith("|")
        unit_start = (prose.rfind("\n", 0, pos) if in_table else prose.rfind("\n\n", 0, pos)) + 1
        named = [s for s in (_script_of(x) for x in _SCRIPT.findall(prose[unit_start:pos])) if s]
        uses.append((named[-1] if named else "*", m.group(1), span))
    return uses


# ------------------------------------------------------------------------------------------------ gin

@functools.lru_cache(maxsize=None)
def _gin_params() -> dict[str, frozenset[str]]:
    """``{namespace: parameters}`` of every project configurable gin knows once what scripts/train.py imports is
    imported (the trainer package registers ``train``, ``LossConfig``, ``mesh``, ``ray_launch``, ...)."""
    import fp8rl_jax.trainer  # noqa: F401
    from fp8rl_jax.trainer.cli import bindable_parameters

    out: dict[str, set[str]] = {}
    for ns, param, _ in bindable_parameters():
        out.setdefault(ns, set()).add(param)
    return {k: frozenset(v) for k, v in out.items()}


_BINDING = re.compile(r"(?<![\w.%@/-])@?([A-Za-z_]\w*)\.([A-Za-z_*][\w/{},]*)")


def _expand_params(param: str) -> list[str]:
    """``clip_ratio_low/high`` -> both names; ``{a,b}`` expanded."""
    out = []
    for p in _expand_braces(param):
        first, *rest = p.split("/")
        out.append(first)
        stem = first.rsplit("_", 1)[0] + "_" if "_" in first else ""
        out += [r if r.startswith(stem) or not stem else stem + r for r in rest if r]
    return out


def _gin_problems(doc: str) -> list[str]:
    prose, blocks = _split_fences(_read(doc))
    known = _gin_params()
    found: list[tuple[str, str, bool]] = []  # (namespace, param, strict: the namespace must be known)
    texts = [s for s, _ in _spans(prose)] + [b for _, b in blocks]
    for t in texts:
        for val in re.findall(r"--gin_param[= ]+('[^']*'|\"[^\"]*\"|\S+)", t):
            for m in _BINDING.finditer(val.strip("'\"").split("=", 1)[0]):
                found.append((m.group(1), m.group(2), True))
    for span, _ in _spans(prose):
        s = span.strip()
        if re.search(r"\.(py|md|gin|json|jsonl|png|ipynb|txt|gguf|parquet|safetensors|sh|cu|cuh)\b", s):
            continue
        for m in _BINDING.finditer(s):
            found.append((m.group(1), m.group(2), False))
    for lang, body in blocks:
        if lang in ("", "gin"):
            for m in re.finditer(r"^\s*([A-Za-z_]\w*)\.(\w+)\s*=", body, flags=re.M):
                found.append((m.group(1), m.group(2), True))
    out = []
    for ns, param, strict in found:
        if ns not in known:
            if strict and not ns.isupper():
                out.append(f"{doc}: gin namespace {ns} ({ns}.{param})")
            continue
        if param.rstrip(".") == "*":
            continue
        for p in _expand_params(param.rstrip(".")):
            if p not in known[ns] and f"{ns}.{p}" not in EXTERNAL:
                out.append(f"{doc}: gin binding {ns}.{p}")
    return out


# ------------------------------------------------------------------------------------------------ the rest

def _make_targets() -> set[str]:
    with open(os.path.join(ROOT, "Makefile")) as f:
        return set(re.findall(r"^([\w-]+):", f.read(), flags=re.M))


def _module_source(dotted: list[str]) -> tuple[str, list[str]] | None:
    """The source of the longest module prefix of ``dotted`` and the attribute names after it."""
    for i in range(len(dotted), 0, -1):
        base = os.path.join(ROOT, *dotted[:i])
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    return f.read(), dotted[i:]
    return None


def _other_problems(doc: str) -> list[str]:
    prose, blocks = _split_fences(_read(doc))
    texts = [s for s, _ in _spans(prose)] + [b for _, b in blocks]
    out = []
    targets = _make_targets()
    for t in texts:
        for m in re.finditer(r"(?<![\w-])make ([a-z][\w-]*)", t):
            if m.group(1) not in targets:
                out.append(f"{doc}: make target {m.group(1)}")
        for m in re.finditer(r"(?<![\w./])((?:fp8rl_jax|rollout_bridge)(?:\.\w+)+)", t):
            dotted = m.group(1).split(".")
            found = _module_source(dotted)
            if found is None:
                out.append(f"{doc}: module {m.group(1)}")
                continue
            src, attrs = found
            for a in attrs[:2]:
                if not re.search(rf"\b{re.escape(a)}\b", src):
                    out.append(f"{doc}: {m.group(1)} ({a} is not in its module)")
                    break
        for m in re.finditer(r"(tests/test_\w+\.py)::(\w+)", t):
            path = os.path.join(ROOT, m.group(1))
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    if not re.search(rf"^\s*def {m.group(2)}\(", f.read(), flags=re.M):
                        out.append(f"{doc}: test {m.group(1)}::{m.group(2)}")
    return out


# ------------------------------------------------------------------------------------------------ tests

def test_the_doc_parser_finds_what_it_checks():
    """The extraction itself: a wrapped span, a fenced command with a continuation, braces, a table row."""
    prose, blocks = _split_fences("a `python scripts/plan.py\n--mesh=fsdp=8` b\n\n```bash\npython scripts/train.py \\\n"
                                  "    --resume # x\n```\n| slime `--use-tis` |\n")
    assert [s for s, _ in _spans(prose)] == ["python scripts/plan.py\n--mesh=fsdp=8", "--use-tis"]
    assert _commands(blocks[0][1]) == ["python scripts/train.py      --resume"]
    assert _expand_braces("exp{1..3}_{a,b}") == ["exp1_a", "exp1_b", "exp2_a", "exp2_b", "exp3_a", "exp3_b"]
    assert _expand_params("clip_ratio_low/high") == ["clip_ratio_low", "clip_ratio_high"]
    assert _unit_of(prose, prose.index("--use-tis")).startswith("| slime")


@pytest.mark.parametrize("doc", DOCS)
def test_named_paths_exist(doc):
    problems = _path_problems(doc)
    assert not problems, "paths the docs name that do not exist:\n" + "\n".join(problems)


def test_named_script_flags_exist():
    problems = []
    every = set()
    for s in _project_scripts():
        every |= _script_flags(s) or set()
    for doc in DOCS:
        for script, flag, where in _flag_uses(doc):
            if script == "*":
                ok = flag in every
            else:
                flags = _script_flags(script)
                ok = flags is not None and flag in flags
            if not ok and f"{script} {flag}" not in EXTERNAL:
                problems.append(f"{doc}: {script} {flag}   (in: {where!r})")
    assert not problems, "script flags the docs name that the scripts do not have:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS)
def test_named_gin_bindings_exist(doc):
    problems = sorted(set(_gin_problems(doc)))
    assert not problems, "gin bindings the docs name that gin does not know:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS)
def test_named_make_targets_modules_and_tests_exist(doc):
    problems = _other_problems(doc)
    assert not problems, "names the docs use that the code does not have:\n" + "\n".join(problems)


def test_the_checks_catch_a_wrong_name(tmp_path):
    """Each check fails on a doc naming something that is not there (so a green run means something)."""
    doc = tmp_path / "BAD.md"
    doc.write_text("See `configs/nope.gin` and `train.no_such_knob = 1`, run `python scripts/train.py --no_such_flag`"
                   ", `make no-such-target`, `fp8rl_jax.assets.no_such_function`.\n", encoding="utf-8")
    rel = os.path.relpath(doc, ROOT)
    assert _path_problems(rel) == [f"{rel}: path configs/nope.gin"]
    assert _gin_problems(rel) == [f"{rel}: gin binding train.no_such_knob"]
    assert ("scripts/train.py", "--no_such_flag") in [(s, f) for s, f, _ in _flag_uses(rel)]
    assert "--no_such_flag" not in _script_flags("scripts/train.py")
    assert _other_problems(rel) == [f"{rel}: make target no-such-target",
                                    f"{rel}: fp8rl_jax.assets.no_such_function (no_such_function is not in its module)"]


def test_readme_notebook_times_are_the_recorded_ones():
    """The README's notebook table gives each notebook's wall time as its committed outputs recorded it
    (``metadata.fp8rl.executed_s`` / ``executed_at``, written by ``scripts/run_notebooks.py --write``)."""
    rows = re.findall(r"^\| `(examples/\w+\.ipynb)` \|.*\| (\d+) s \((\d{4}-\d\d-\d\d)\) \|$", _read("README.md"),
                      flags=re.M)
    assert len(rows) == len(glob.glob(os.path.join(ROOT, "examples", "*.ipynb"))) >= 4, rows
    for path, seconds, date in rows:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            meta = json.load(f)["metadata"]["fp8rl"]
        assert abs(float(seconds) - meta["executed_s"]) <= 1, (path, seconds, meta)
        assert meta["executed_at"].startswith(date), (path, date, meta)


def test_nothing_points_outside_the_repository():
    """The docs, and the code that sends users to a doc, name files of this repository only (issue 39, item 6: the
    asset notes live in docs/ASSETS.md, not in a ``shared/`` folder beside the checkout)."""
    files = DOCS + ["Makefile", "fp8rl_jax/assets.py", "fp8rl_jax/models/loading.py", "fp8rl_jax/models/gguf_io.py"]
    problems = [f"{f}: {m.group(0)}" for f in files for m in re.finditer(r"(?<![\w/-])(?:\.\./)*shared/[\w./-]+",
                                                                        _read(f))]
    assert not problems, "references to files outside the repository:\n" + "\n".join(problems)
    for f in ("Makefile", "fp8rl_jax/assets.py", "fp8rl_jax/models/loading.py"):
        assert "docs/ASSETS.md" in _read(f), f
