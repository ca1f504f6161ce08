"""The docs say what is true: their Python snippets run, their links and anchors resolve,
api.md lists exactly ``lockaspect.__all__`` and its signatures match the code.

How a page's snippets run (docs/writing-docs.md says it to writers):

- Every ```` ```python ```` block of a page in docs/ and of README.md runs, in the page's
  order, in one namespace per page (so a snippet may use what an earlier one on the page
  defined), in this process, against an embedded Valkey started for this module:
  ``LOCKASPECT_URL`` points at it, and ``127.0.0.1:6379`` / ``localhost:6379`` in a snippet
  are rewritten to its address. Clients the page left open are closed after it.
- A block right after ``<!-- not-runnable: why -->`` does not run (it needs a server the
  check does not start, shows a fragment, ...); the reason is required.
- A block right after ``<!-- signatures -->`` does not run either: each ``name(parameters)``
  statement in it is compared with ``inspect.signature`` of the object it names.

A failure names the file and line of the block (and the traceback's line numbers are the
Markdown file's own).
"""

from __future__ import annotations

import ast
import contextvars
import gc
import inspect
import keyword
import logging
import math
import re
import sys
import time
import traceback
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import lockaspect
import lockaspect.fencing
import lockaspect.testing
from lockaspect import LockClient
from lockaspect.blocks import RWLock
from lockaspect.options import DEFAULTS, UNSET
from lockaspect.testing import LockServer

from ._markdown import Block, anchors, blocks, links

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
README = ROOT / "README.md"
#: Links from docs/ to the rest of the repository use this prefix (mkdocs builds docs/ alone).
REPOSITORY = "https://github.com/lockaspect/lockaspect/"
#: Pages other branches of issue 14 add: until they are merged, links and nav entries may
#: name them. Once a page exists it is checked like any other (then drop it from here).
LOCAL_REDIS = re.compile(r"\b(?:localhost|127\.0\.0\.1):6379\b")
SIGNATURES = "<!-- signatures -->"
CONTINUES = "<!-- continues -->"


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def python_blocks(page: Path) -> list[Block]:
    return [block for block in blocks(page) if block.lang == "python"]


def runnable(page: Path) -> list[Block]:
    return [block for block in python_blocks(page) if block.not_runnable is None and not is_signatures(block)]


def is_signatures(block: Block) -> bool:
    return block.previous == SIGNATURES


RUNNABLE_PAGES = [page for page in [*PAGES, README] if runnable(page)]


@pytest.fixture(scope="module")
def docs_server() -> Iterator[LockServer]:
    with LockServer() as server:
        yield server


def test_every_not_runnable_marker_gives_a_reason() -> None:
    missing = [block.where(ROOT) for page in [*PAGES, README] for block in blocks(page) if block.not_runnable == ""]
    assert not missing, f"<!-- not-runnable: why --> without the why before the blocks at {missing}"


def fixtures_for(function: Callable[..., Any], server: LockServer, made: list[LockClient]) -> dict[str, Any]:
    """The values of the lockaspect pytest plugin's fixtures a snippet's test function asks for."""
    values: dict[str, Any] = {}
    for name in inspect.signature(function).parameters:
        if name == "lock_server":
            values[name] = server
        elif name == "lock_client":
            made.append(LockClient.from_url(server.url, namespace=f"test-{uuid.uuid4().hex[:12]}:"))
            values[name] = made[-1]
        else:
            raise LookupError(f"{function.__name__} asks for the fixture {name!r}, which the docs check does not give")
    return values


def run_block(block: Block, namespace: dict[str, Any], server: LockServer) -> None:
    """Run ``block`` in ``namespace``, then the ``test_*`` functions it defined, as pytest would."""
    # Padding puts the snippet's lines at their line numbers in the Markdown file.
    source = "\n" * block.line + LOCAL_REDIS.sub(f"127.0.0.1:{server.port}", block.code)
    before = dict(namespace)
    exec(compile(source, str(block.path), "exec"), namespace)
    for name, value in list(namespace.items()):
        if name.startswith("test_") and inspect.isfunction(value) and before.get(name) is not value:
            made: list[LockClient] = []
            try:
                value(**fixtures_for(value, server, made))
            finally:
                for client in made:
                    client.close()


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=relative)
def test_the_python_snippets_of_a_page_run(
    page: Path, docs_server: LockServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKASPECT_URL", docs_server.url)
    monkeypatch.chdir(ROOT)
    before = {id(obj) for obj in gc.get_objects() if isinstance(obj, LockClient)}
    namespace: dict[str, Any] = {}
    # The page's own context: a lease a snippet leaves entered (current_lease) stays there.
    context = contextvars.copy_context()
    # Logging as the snippets found it (docs/logging.md sets levels and handlers).
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    logging_state = [(logger, logger.level, list(logger.handlers)) for logger in loggers]
    try:
        for block in runnable(page):
            if block.previous != CONTINUES:
                # A module in sys.modules, as a pasted script's __main__ is (dataclasses look it up).
                module = types.ModuleType("__docs__")
                monkeypatch.setitem(sys.modules, module.__name__, module)
                namespace = module.__dict__
            try:
                context.run(run_block, block, namespace, docs_server)
            except Exception as exc:  # noqa: BLE001 - whatever a snippet raises fails the docs, naming its block
                pytest.fail(
                    f"the ```python block at {block.where(ROOT)} raised {exc!r} (it runs on its own, or after "
                    "the block before it when marked <!-- continues -->; mark it <!-- not-runnable: why --> "
                    "if it is not meant to run):\n" + "".join(traceback.format_exception(exc)),
                    pytrace=False,
                )
    finally:
        for obj in gc.get_objects():
            if isinstance(obj, LockClient) and id(obj) not in before and not obj.closed:
                obj.close()
        for logger, level, handlers in logging_state:
            logger.setLevel(level)
            logger.handlers[:] = handlers
        for name in set(logging.root.manager.loggerDict) - {logger.name for logger in loggers}:
            logging.getLogger(name).setLevel(logging.NOTSET)  # made by a snippet


def link_problems(page: Path) -> Iterator[str]:
    in_docs = DOCS in page.parents
    for link in links(page):
        target = link.target
        where = f"{relative(page)}:{link.line}: ({target})"
        if target.startswith(REPOSITORY):
            path = re.sub(r"^(?:blob|tree)/main/", "", target.removeprefix(REPOSITORY)).split("#")[0]
            if not (ROOT / path).exists():
                yield f"{where}: {path} is not in the repository"
            continue
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # another site, mailto:
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            yield f"{where}: {path_part} does not exist"
            continue
        if in_docs and DOCS not in resolved.parents:
            yield f"{where}: leaves docs/ (the site has only docs/): link to {REPOSITORY}blob/main/<path>"
            continue
        if anchor:
            if resolved.suffix != ".md":
                yield f"{where}: an anchor into a file that is not Markdown"
                continue
            github, mkdocs = anchors(resolved)
            if anchor not in github or anchor not in mkdocs:
                which = " and ".join(
                    name for name, found in (("GitHub", github), ("mkdocs", mkdocs)) if anchor not in found
                )
                yield f"{where}: no heading of {relative(resolved)} has the anchor #{anchor} on {which}"


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = [problem for page in [*PAGES, README] for problem in link_problems(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def api_import_list() -> tuple[Block, list[str]]:
    for block in python_blocks(DOCS / "api.md"):
        tree = ast.parse(block.code)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "lockaspect":
                return block, [alias.name for alias in node.names]
    pytest.fail("docs/api.md has no `from lockaspect import (...)` block")


def test_api_md_imports_exactly_what_lockaspect_exports() -> None:
    block, names = api_import_list()
    exported = set(lockaspect.__all__)
    missing, extra = sorted(exported - set(names)), sorted(set(names) - exported)
    assert not missing, f"the import list at {block.where(ROOT)} lacks {missing} (in lockaspect.__all__)"
    assert not extra, f"the import list at {block.where(ROOT)} has {extra}, which lockaspect.__all__ does not"
    assert names == sorted(names, key=lambda name: (not name[0].isupper(), name)), (
        f"keep the import list at {block.where(ROOT)} sorted (classes first), as __all__ is"
    )


def test_api_md_documents_every_export() -> None:
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    _, names = api_import_list()
    body = text.split("```", 2)[2]  # after the import list
    undocumented = [name for name in names if f"`{name}" not in body]
    assert not undocumented, f"docs/api.md imports but never describes {undocumented}"


#: What a signature statement's first name stands for, besides lockaspect's own names.
RECEIVERS: dict[str, Any] = {"client": LockClient, "rw": RWLock, "lease": lockaspect.Lease}


def resolve(dotted: str) -> Any:
    head, *rest = dotted.split(".")
    if head in RECEIVERS:
        obj = RECEIVERS[head]
    elif head == "lockaspect":
        obj = lockaspect
    else:
        # lockaspect.fencing loads its Redis classes on first access: getattr, not vars()
        module = next((m for m in (lockaspect, lockaspect.fencing, lockaspect.testing) if hasattr(m, head)), None)
        if module is None:
            raise LookupError(dotted)
        obj = getattr(module, head)
    for name in rest:
        obj = getattr(obj, name)
    return obj


def statements(code: str) -> Iterator[tuple[int, str, str]]:
    """(line offset, dotted name, parameter text) of each ``name(...)`` statement of a block."""
    lines = [re.sub(r"\s+#.*$", "", line) for line in code.splitlines()]
    text = "\n".join(lines)
    for match in re.finditer(r"^(?:await\s+|\w+\s*=\s*)?(?P<name>[A-Za-z_][\w.]*)\(", text, re.MULTILINE):
        depth, end = 1, match.end()
        while depth and end < len(text):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        yield text.count("\n", 0, match.start()), match["name"], text[match.end() : end - 1]


def documented(parameters: str) -> inspect.Signature:
    function = ast.parse(f"def documented({parameters}): pass").body[0]
    assert isinstance(function, ast.FunctionDef)
    args = function.args
    result: list[inspect.Parameter] = []
    defaults: list[ast.expr | None] = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(args.args, defaults, strict=True):
        result.append(parameter(arg.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default))
    if args.vararg:
        result.append(inspect.Parameter(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        result.append(parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY, kw_default))
    if args.kwarg:
        result.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(result)


def parameter(name: str, kind: Any, default: ast.expr | None) -> inspect.Parameter:
    if default is None:
        return inspect.Parameter(name, kind)
    value = eval(compile(ast.Expression(default), "<default>", "eval"), {"time": time, "math": math})
    return inspect.Parameter(name, kind, default=value)


def actual(obj: Any) -> inspect.Signature:
    signature = inspect.signature(obj)
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]
    return signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty)


def signature_differences(doc: inspect.Signature, code: inspect.Signature) -> list[str]:
    doc_params, code_params = doc.parameters, code.parameters
    differences = [f"missing {name}" for name in code_params if name not in doc_params]
    differences += [f"no parameter {name}" for name in doc_params if name not in code_params]
    if [n for n in doc_params if n in code_params] != [n for n in code_params if n in doc_params]:
        differences.append(f"order: the code has ({', '.join(code_params)})")
    for name in doc_params.keys() & code_params.keys():
        said, real = doc_params[name], code_params[name]
        if said.kind != real.kind:
            differences.append(f"{name} is {real.kind.description} in the code")
        if real.default is UNSET and name in DEFAULTS:
            # A decorator option a policy may set: its default is the library's.
            real = real.replace(default=DEFAULTS[name])
        if (said.default is inspect.Parameter.empty) != (real.default is inspect.Parameter.empty):
            differences.append(f"{name}: a default in one and not the other")
        elif real.default is not inspect.Parameter.empty and is_plain(real.default) and said.default != real.default:
            differences.append(f"{name}: default {real.default!r} in the code, {said.default!r} in the docs")
    return differences


def is_plain(value: Any) -> bool:
    """A default the docs can spell (policy-aware options have a sentinel the docs explain)."""
    return value is None or isinstance(value, (bool, int, float, str)) or callable(value)


def signature_blocks() -> list[Block]:
    return [block for page in [*PAGES, README] for block in python_blocks(page) if is_signatures(block)]


def test_there_are_signature_blocks() -> None:
    assert len(signature_blocks()) >= 10


@pytest.mark.parametrize("block", signature_blocks(), ids=lambda block: block.where(ROOT))
def test_documented_signatures_match_the_code(block: Block) -> None:
    problems: list[str] = []
    for offset, name, parameters in statements(block.code):
        where = f"{relative(block.path)}:{block.line + 1 + offset}: {name}"
        try:
            doc = documented(parameters)
        except SyntaxError as exc:
            if "..." not in parameters:
                problems.append(f"{where}: the parameters do not parse ({exc.msg})")
            continue  # with "...": "the same options", said in words
        try:
            code = actual(resolve(name))
        except (LookupError, AttributeError):
            problems.append(f"{where}: no such object in lockaspect")
            continue
        problems += [f"{where}: {difference}" for difference in signature_differences(doc, code)]
    assert not problems, "signatures that differ from the code:\n" + "\n".join(problems)


MEMBER_TABLE = re.compile(r"^\|\s*(member|attribute|method)\s*\|")


def has_member(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute, or one its methods set."""
    if hasattr(cls, name):
        return True
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{name}\s*[:=]|^\s+{name}\s*:", source, re.MULTILINE):
            return True
    return False


def member_tables(page: Path) -> Iterator[tuple[int, type, list[str]]]:
    """(line, class, names) of each member/attribute/method table, for the class the nearest
    heading above it names in backticks."""
    lines = page.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        if not MEMBER_TABLE.match(line):
            continue
        owner = None
        for above in reversed(lines[:number]):
            if above.startswith("#"):
                for name in re.findall(r"`([\w.]+)", above):
                    try:
                        candidate = resolve(name)
                    except (LookupError, AttributeError):
                        continue
                    if isinstance(candidate, type):
                        owner = candidate
                        break
                if owner is not None:
                    break
        if owner is None:
            continue
        names: list[tuple[int, str]] = []
        for offset, row in enumerate(lines[number + 2 :], start=number + 3):
            if not row.startswith("|"):
                break
            first_cell = re.split(r"(?<!\\)\|", row)[1]
            found = re.findall(r"`(?:await\s+)?([A-Za-z_]\w*)", first_cell)
            names += [(offset, name) for name in found if not keyword.iskeyword(name)]
        yield number + 1, owner, [f"{offset}:{name}" for offset, name in names]


def test_member_tables_name_members_that_exist() -> None:
    problems = []
    checked = 0
    for page in PAGES:
        for _line, owner, names in member_tables(page):
            for entry in names:
                row, name = entry.split(":")
                checked += 1
                if not has_member(owner, name):
                    problems.append(f"{relative(page)}:{row}: {owner.__name__} has no member {name!r}")
    assert checked > 50
    assert not problems, "tables of members that do not exist:\n" + "\n".join(problems)


def nav_entries() -> list[tuple[int, str]]:
    """(line, page) of each page in mkdocs.yml's nav (a plain reading: ``- [Title: ]page.md``)."""
    lines = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").splitlines()
    start = lines.index("nav:")
    entries = []
    for number, line in enumerate(lines[start + 1 :], start=start + 2):
        if line and not line.startswith(" "):
            break
        match = re.match(r"^\s*-\s+(?:[^:]+:\s+)?(\S+\.md)\s*$", line)
        if match:
            entries.append((number, match.group(1)))
    return entries


def test_the_site_nav_has_every_page_and_only_pages_that_exist() -> None:
    entries = nav_entries()
    named = {DOCS / page for _, page in entries}
    missing = [relative(page) for page in PAGES if page not in named]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"
    absent = [f"mkdocs.yml:{line}: {page}" for line, page in entries if not (DOCS / page).exists()]
    assert not absent, f"nav entries without a page: {absent}"
    assert len(entries) == len(named), "a page is in the nav twice"


def test_every_image_in_docs_is_shown() -> None:
    shown = {(link.path.parent / link.target).resolve() for page in PAGES for link in links(page) if link.image}
    unshown = [relative(image) for image in sorted((DOCS / "img").glob("*")) if image.resolve() not in shown]
    assert not unshown, f"images no page shows (benchmark plots belong on docs/benchmarks.md): {unshown}"
