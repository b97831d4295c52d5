"""Every ```python block of README.md and docs/**/*.md runs, and every relative link resolves.

Snippets
    Each ```python block runs on its own, in a fresh namespace (``exec`` of the block's
    text, ``__name__ == "__doc_snippet__"``): a block is a complete example a reader can
    copy.  A block that needs something the plain CPU install lacks says so in an HTML
    comment on the line right before its opening fence (blank lines between are
    allowed)::

        <!-- snippet: needs=torch,cuda -->

    Known requirements (NEEDS below): ``torch``, ``triton``, ``transformers``, ``wgpu``
    (wgpu-py with an adapter), ``cuda`` (a CUDA GPU through torch), ``multiprocess``
    (the block is a script for several processes: it runs as a file under
    ``torchrun --nproc-per-node 2`` and must finish by itself).  A block is skipped only
    when one of its requirements is absent here; a marker with an unknown requirement
    or any other ``snippet:`` comment fails the test.  Blocks are kept small (the whole
    set runs in well under a minute on two CPU cores).

Links
    Every relative link ``[text](path#anchor)`` in README.md and docs/**/*.md names an
    existing file or folder; an anchor into a Markdown file names one of its headings
    (GitHub's slugs: lower case, punctuation dropped, spaces to ``-``, repeats ``-1``,
    ``-2``...).  Links with a scheme (https:, mailto:) are not fetched.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS = ("torch", "triton", "transformers", "wgpu", "cuda", "multiprocess")

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*snippet:(.*?)-->\s*$")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
                   r"|!\[[^\]]*\]\(\s*<?([^)\s>]+)>?\s*\)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def parse_blocks(text: str):
    """-> [(line, language, code, marker or None)] for every fenced block of ``text``.

    ``marker`` is the text after ``snippet:`` of an HTML comment on the last non-blank
    line before the fence."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        body = []
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mm = _MARKER.match(lines[k]) if k >= 0 else None
        out.append((i + 1, lang, "\n".join(body) + "\n", mm.group(1).strip() if mm else None))
        i = j + 1
    return out


def parse_marker(marker: str | None) -> tuple[str, ...]:
    """``needs=a,b`` -> ("a", "b"); raises ValueError for anything else."""
    if marker is None:
        return ()
    m = re.fullmatch(r"needs=([\w,-]+)", marker)
    if not m:
        raise ValueError(f"snippet marker {marker!r}: expected 'needs=<req>[,<req>...]' "
                         f"with <req> one of {', '.join(NEEDS)}")
    needs = tuple(m.group(1).split(","))
    unknown = [n for n in needs if n not in NEEDS]
    if unknown:
        raise ValueError(f"snippet marker {marker!r}: unknown requirement(s) "
                         f"{', '.join(unknown)}; known: {', '.join(NEEDS)}")
    return needs


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@functools.lru_cache(maxsize=None)
def missing(need: str) -> str | None:
    """Why ``need`` is absent on this machine, or None when it is present."""
    if need in ("torch", "triton", "transformers", "wgpu"):
        return None if _has(need) else f"{need} is not installed"
    if need == "cuda":
        if not _has("torch"):
            return "torch is not installed"
        import torch
        return None if torch.cuda.is_available() else "no CUDA GPU"
    if need == "multiprocess":
        if not _has("torch"):
            return "torch is not installed"
        import torch.distributed as dist
        return None if dist.is_available() and dist.is_gloo_available() else \
            "torch.distributed with gloo is not available"
    raise AssertionError(need)


def _wgpu_adapter() -> str | None:
    """Why the webgpu backend cannot run here (no adapter), or None."""
    import anyattn
    return dict(anyattn.describe_backends()).get("webgpu")


def collect():
    cases = []
    for path in doc_files():
        for line, lang, code, marker in parse_blocks(path.read_text(encoding="utf-8")):
            if lang in ("python", "py"):
                cases.append(pytest.param(path, line, code, marker,
                                          id=f"{_rel(path)}:{line}"))
    return cases


def run_block(code: str, name: str) -> None:
    """Execute one snippet in a fresh namespace."""
    namespace = {"__name__": "__doc_snippet__"}
    exec(compile(code, name, "exec"), namespace)


@pytest.mark.parametrize("path,line,code,marker", collect())
def test_snippet_runs(path, line, code, marker, tmp_path, monkeypatch):
    needs = parse_marker(marker)   # an unknown marker fails here, present or not
    for need in needs:
        why = missing(need)
        if why is None and need == "wgpu":
            why = _wgpu_adapter()
        if why is not None:
            pytest.skip(f"needs {need}: {why}")
    name = f"{_rel(path)}:{line}"
    if "multiprocess" in needs:
        script = tmp_path / "snippet.py"
        script.write_text(code, encoding="utf-8")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
            OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", str(script)]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"{name} under torchrun failed:\n{r.stdout}\n{r.stderr}"
        return
    monkeypatch.chdir(tmp_path)     # a snippet that writes files writes them here
    run_block(code, name)


# ---- the checker checks -------------------------------------------------------------

def test_parse_blocks_and_markers():
    text = ("intro\n<!-- snippet: needs=torch -->\n\n```python\nx = 1\n```\n"
            "```bash\nls\n```\n<!-- snippet: needs=gpu -->\n```python\ny = 2\n```\n")
    blocks = parse_blocks(text)
    assert [(b[1], b[3]) for b in blocks] == [("python", "needs=torch"), ("bash", None),
                                              ("python", "needs=gpu")]
    assert blocks[0][2] == "x = 1\n"
    assert parse_marker("needs=torch,cuda") == ("torch", "cuda")
    assert parse_marker(None) == ()
    with pytest.raises(ValueError, match="unknown requirement"):
        parse_marker(blocks[2][3])
    with pytest.raises(ValueError, match="expected 'needs="):
        parse_marker("skip")


def _readme_tour() -> str:
    blocks = [b for b in parse_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
              if b[1] == "python"]
    assert blocks, "README.md has no python block"
    return blocks[0][2]


@pytest.mark.parametrize("wrong,right", [
    # the output passed where the output's gradient belongs (the README's old mistake)
    ("aa.attention_backward(q64, k64, v64, aa.attention(q64, k64, v64, **mods),",
     "aa.attention_backward(q64, k64, v64, dout64,"),
    # a backward without the ALiBi slopes its forward used (the other old mistake)
    ('wrt=("q", "sinks"), **{n: x for n, x in mods.items() if n != "alibi_slopes"})',
     'wrt=("q", "sinks"), **mods)'),
], ids=["out-as-dout", "backward-without-alibi"])
def test_the_tour_catches_its_old_mistakes(wrong, right):
    """The README tour checks its gradients by a central difference, so the two mistakes
    it once made fail its own snippet."""
    code = _readme_tour()
    assert right in code, "the README tour changed: update this test"
    with pytest.raises(AssertionError):
        run_block(code.replace(right, wrong), "README tour, broken")


def test_there_are_snippets():
    assert len(collect()) >= 8, "README and docs/ lost their examples"


# ---- links --------------------------------------------------------------------------

def github_slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown``."""
    slugs, seen = set(), {}
    in_fence = None
    for line in markdown.splitlines():
        m = _FENCE.match(line)
        if m:
            if in_fence is None:
                in_fence = m.group(2)
            elif line.strip().startswith(in_fence):
                in_fence = None
            continue
        if in_fence is not None:
            continue
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not h:
            continue
        title = re.sub(r"`([^`]*)`", r"\1", h.group(1))
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def links(path: Path):
    """-> [(line, target)] of the Markdown links outside code in ``path``."""
    out, in_fence = [], None
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            if in_fence is None:
                in_fence = m.group(2)
            elif line.strip().startswith(in_fence):
                in_fence = None
            continue
        if in_fence is not None:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for lm in _LINK.finditer(line):
            out.append((no, lm.group(1) or lm.group(2)))
    return out


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_relative_links_resolve(path):
    bad = []
    for no, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue                           # https:, mailto: ...
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{_rel(path)}:{no}: {target}: no such file")
            continue
        try:
            dest.relative_to(ROOT)
        except ValueError:
            bad.append(f"{_rel(path)}:{no}: {target}: outside the repository")
            continue
        if anchor and dest.suffix == ".md":
            if anchor not in github_slugs(dest.read_text(encoding="utf-8")):
                bad.append(f"{_rel(path)}:{no}: {target}: no heading with anchor #{anchor}")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_slugs_and_links_checker(tmp_path):
    md = "# A `b` (c)\n## Device arrays (`anyattn.webgpu`)\n## A `b` (c)\n"
    assert github_slugs(md) == {"a-b-c", "device-arrays-anyattnwebgpu", "a-b-c-1"}
    page = tmp_path / "page.md"
    page.write_text("See [x](a.md#b), ![p](img.png) and `[no](code.md)`.\n"
                    "```\n[no](in-fence.md)\n```\n[y](https://e.org) [z](#top)\n")
    assert links(page) == [(1, "a.md#b"), (1, "img.png"), (5, "https://e.org"), (5, "#top")]


def test_no_references_to_files_outside_or_missing():
    """No doc names DESIGN.md (not in the repository) or a path outside it."""
    bad = []
    for path in doc_files():
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "DESIGN.md" in line or "../shared/" in line:
                bad.append(f"{_rel(path)}:{no}: {line.strip()[:100]}")
    assert not bad, "references outside the repository:\n" + "\n".join(bad)


def test_readme_test_command_is_ci_command():
    """The README's test command is the last line of .ci/run, character for character."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    bash = [b[2].strip() for b in parse_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
            if b[1] in ("bash", "sh")]
    assert ci in bash, f"README.md has no bash block equal to .ci/run's command:\n{ci}"


def test_readme_size():
    """The README stays a front page (details live in docs/)."""
    assert (ROOT / "README.md").stat().st_size <= 8 * 1024
