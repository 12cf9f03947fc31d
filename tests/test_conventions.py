"""Static checks of the project's conventions (../shared/STYLE.md); no model is loaded.

Each check is a pure function that takes text (or paths) and returns a list of problems, one
readable line each. The tests assert that the list is empty for the real repository, and a
negative self-test per checker feeds it a small bad input and asserts that it complains, so that
a checker that silently stopped checking would be noticed.

  a. `# Detail N: <title>` tags vs the registry docs/details.md (and the 25 titles)
  b. tests named in the registry exist
  c. every field of an `...Args` dataclass has a docstring and is read
  d. same-named top-level helpers agree across stage scripts (single-file design): the same code, docstrings
     and comments aside, or copies cut to what each stage uses, with a test that they agree
  e. importing a stage script runs nothing (subprocess)
  f. `python <script> --help` exits 0 and lists every flag (subprocess)
  g. every repository path that README.md, benchmark/README.md and docs/details.md name exists
  h. a stage reads as the algorithm above one fence line, its plumbing and fast paths below
  i. each stage's front page runs the tiny world with the flags benchmark/tiny.sh gives it (subprocess: bash)
  j. every command that README.md, benchmark/README.md, docs/details.md and the scripts' front pages write gives
     its script flags it has: each a field of its Args, a value after each non-bool flag, none after a bool
  k. every scalar ppo.py logs has its row in docs/details.md's table beside the paper's W&B names, and no row names
     a scalar ppo.py no longer logs

Tests about stage scripts are parametrized over the scripts that exist, so they grow as stages land.
"""

import ast
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

# HELP_ENV: the environment of every --help run (wide, colourless)
from conftest import HELP_ENV, early_exits

REPO = Path(__file__).resolve().parent.parent
REGISTRY = REPO / "docs" / "details.md"
README = REPO / "README.md"
# CI clones the repository with ../shared beside it; checks that read it skip when it is absent.
SHARED_DETAILS = REPO.parent / "shared" / "DETAILS.md"

# The stage scripts, in pipeline order. A new stage script must be added here.
STAGE_SCRIPTS = ("preprocess_tldr.py", "sft.py", "reward.py", "dpo.py", "ppo.py", "judge.py")
PRESENT_STAGES = [name for name in STAGE_SCRIPTS if (REPO / name).is_file()]
# Scripts with a CLI that are not stages (no training path) still follow the Args / import / --help
# conventions; the helper-identity check applies to stages only.
TOOL_SCRIPTS = ("tiny_world.py",)
CLI_SCRIPTS = PRESENT_STAGES + [name for name in TOOL_SCRIPTS if (REPO / name).is_file()]

# The 25 titles, exactly as in ../shared/DETAILS.md (test_titles_match_shared_details checks them).
TITLES = {
    1: "Dataset specification",
    2: "Truncate the paragraph, not the sentence",
    3: "Leading space, EOS at the end, a distinct [PAD]",
    4: "SFT and preference lengths differ",
    5: "Pre-tokenize; right-pad query+response, left-pad queries",
    6: "The preference validation split is out of distribution",
    7: "Disable dropout",
    8: "Tech stack",
    9: "SFT setup",
    10: "RM setup",
    11: "Reward head initialisation",
    12: "Extract the reward at the EOS token",
    13: "Non-EOS reward logits are not valid rewards",
    14: "Left- vs right-padded reward extraction",
    15: "Reward normalisation from SFT reference summaries",
    16: "Accuracy differs by batch / confidence / split",
    17: "Agreement with an LLM judge",
    18: "RM calibration",
    19: "DPO as a reward model",
    20: "PPO setup",
    21: "Reuse the SFT prompts, reshuffle at each pass",
    22: "Value model initialised from the RM",
    23: "EOS trick",
    24: "Reward whitening is optional",
    25: "Advantage whitening",
}

SUBPROCESS_TIMEOUT_S = 300


def tagged_files(repo: Path) -> dict[str, str]:
    """Files whose `# Detail N:` tags are checked: root *.py and benchmark/ scripts -> their text."""
    paths = sorted(repo.glob("*.py"))
    paths += sorted(p for p in (repo / "benchmark").rglob("*") if p.suffix in (".py", ".sh"))
    return {p.relative_to(repo).as_posix(): p.read_text() for p in paths if p.is_file()}


def stage_sources(repo: Path) -> dict[str, str]:
    """The stage scripts that exist -> their text."""
    return {name: (repo / name).read_text() for name in STAGE_SCRIPTS if (repo / name).is_file()}


# ---------------------------------------------------------------------------------------------
# a. Tags vs registry
# ---------------------------------------------------------------------------------------------

# A tag is a comment `# Detail N: <title>`, alone on its line or after code.
TAG_RE = re.compile(r"#\s*Detail\s+(\d+)\s*:\s*(.*?)\s*$")
WHERE_RE = re.compile(r"`?([^`\s()]+)`?(\s*\(planned\))?")
TEST_RE = re.compile(r"`?(tests/[\w/]+\.py)::(\w+)`?")


@dataclass
class Row:
    """One row of docs/details.md."""

    n: int
    title: str
    stages: str
    where: list[tuple[str, bool]]  # (path, planned)
    tests: list[tuple[str, str]]  # (tests/file.py, test name); empty when the cell says planned


def parse_registry(text: str) -> tuple[dict[int, Row], list[str]]:
    """docs/details.md -> ({N: Row}, problems met while parsing)."""
    rows: dict[int, Row] = {}
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not cells[0].isdigit():
            continue  # prose, the header row, the separator row
        where_at = f"docs/details.md:{lineno}"
        if len(cells) != 5:
            problems.append(f"{where_at}: expected 5 cells (N | Title | Stages | Where | Test), got {len(cells)}")
            continue
        n, title, stages, where_cell, test_cell = int(cells[0]), cells[1], cells[2], cells[3], cells[4]
        if n in rows:
            problems.append(f"{where_at}: Detail {n} has a second row")
        where = []
        for item in filter(None, (s.strip() for s in where_cell.split(","))):
            m = WHERE_RE.fullmatch(item)
            if m is None:
                problems.append(f"{where_at}: cannot read where-entry {item!r} (want `file` or `file` (planned))")
            else:
                where.append((m.group(1), m.group(2) is not None))
        if not where:
            problems.append(f"{where_at}: Detail {n} lists no file under 'Where in the code'")
        tests = []
        if test_cell != "planned":
            for item in (s.strip() for s in test_cell.split(",")):
                m = TEST_RE.fullmatch(item)
                if m is None:
                    want = "tests/<file>.py::<name> or planned"
                    problems.append(f"{where_at}: cannot read test entry {item!r} (want {want})")
                else:
                    tests.append((m.group(1), m.group(2)))
        rows[n] = Row(n, title, stages, where, tests)
    return rows, problems


def check_registry_rows(rows: dict[int, Row], titles: dict[int, str]) -> list[str]:
    """The registry has exactly the rows 1..25, in order, with the paper's titles."""
    problems = []
    if list(rows) != sorted(titles):
        missing = sorted(set(titles) - set(rows))
        extra = sorted(set(rows) - set(titles))
        problems.append(
            f"registry rows are {list(rows)}; missing {missing}, unknown {extra}, want 1..{len(titles)} in order"
        )
    for n, row in rows.items():
        if n in titles and row.title != titles[n]:
            problems.append(f"registry Detail {n}: title {row.title!r} != {titles[n]!r}")
    return problems


def find_tags(text: str) -> list[tuple[int, int, str]]:
    """Source text -> [(line number, N, title)] for every `# Detail N: <title>` comment."""
    tags = []
    for lineno, line in enumerate(text.splitlines(), 1):
        m = TAG_RE.search(line)
        if m:
            tags.append((lineno, int(m.group(1)), m.group(2)))
    return tags


def check_tags(sources: dict[str, str], rows: dict[int, Row], titles: dict[int, str], repo: Path) -> list[str]:
    """Tags in `sources` ({relative path: text}) agree with the registry rows, both ways."""
    problems = []
    tagged: dict[tuple[int, str], list[int]] = {}  # (N, file) -> lines
    for path, text in sources.items():
        for lineno, n, title in find_tags(text):
            if n not in titles:
                problems.append(f"{path}:{lineno}: Detail {n} does not exist (1..{len(titles)})")
                continue
            if title != titles[n]:
                problems.append(f"{path}:{lineno}: Detail {n} tagged {title!r}, the title is {titles[n]!r}")
            tagged.setdefault((n, path), []).append(lineno)
    for (n, path), lines in sorted(tagged.items()):
        if len(lines) > 1:
            problems.append(f"{path}: Detail {n} tagged {len(lines)} times (lines {lines}); tag it once, where it acts")
        row = rows.get(n)
        listed = row is not None and (path, False) in row.where
        if not listed:
            planned = row is not None and (path, True) in row.where
            hint = "drop its '(planned)'" if planned else "add it"
            problems.append(
                f"{path}:{lines[0]}: tags Detail {n}, but docs/details.md does not list {path} "
                f"under 'Where in the code' ({hint})"
            )
    for n, row in sorted(rows.items()):
        for path, planned in row.where:
            if planned:
                continue
            if not (repo / path).is_file():
                problems.append(f"docs/details.md: Detail {n} lists {path}, which does not exist (planned?)")
            elif (n, path) not in tagged and not any(t[1] == n for t in find_tags((repo / path).read_text())):
                problems.append(f"docs/details.md: Detail {n} lists {path}, which carries no '# Detail {n}:' tag")
    return problems


def parse_details_table(text: str) -> dict[int, tuple[str, str]]:
    """../shared/DETAILS.md -> {N: (title, stages)} from its table (first three cells of a row)."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit() and len(cells) >= 3:
            out[int(cells[0])] = (cells[1], cells[2])
    return out


def test_registry_rows_match_details_titles():
    rows, problems = parse_registry(REGISTRY.read_text())
    problems += check_registry_rows(rows, TITLES)
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not SHARED_DETAILS.is_file(), reason=f"{SHARED_DETAILS} is absent (it sits beside the clone in CI)")
def test_titles_match_shared_details():
    """The hard-coded titles and the registry's stages are those of ../shared/DETAILS.md."""
    shared = parse_details_table(SHARED_DETAILS.read_text())
    rows, _ = parse_registry(REGISTRY.read_text())
    problems = []
    for n, (title, stages) in shared.items():
        if TITLES.get(n) != title:
            problems.append(f"Detail {n}: TITLES has {TITLES.get(n)!r}, DETAILS.md has {title!r}")
        if n in rows and rows[n].stages != stages:
            problems.append(f"Detail {n}: registry stages {rows[n].stages!r}, DETAILS.md has {stages!r}")
    assert len(shared) == len(TITLES), f"DETAILS.md has {len(shared)} details, TITLES has {len(TITLES)}"
    assert not problems, "\n".join(problems)


def test_tags_match_registry():
    rows, problems = parse_registry(REGISTRY.read_text())
    problems += check_tags(tagged_files(REPO), rows, TITLES, REPO)
    assert not problems, "\n".join(problems)


def test_registry_and_tag_checkers_catch_mistakes(tmp_path):
    titles = {1: "Alpha", 2: "Beta"}
    bad_registry = textwrap.dedent("""\
        | N | Title | Stages | Where in the code | Test |
        |---|---|---|---|---|
        | 1 | Alpha | x | `a.py`, `b.py`, `c.py` (planned) | planned |
        | 3 | Gamma | x | `a.py` | planned |
        | 4 | Delta | x |  | nonsense |
        """)
    rows, parse_problems = parse_registry(bad_registry)
    assert any("lists no file" in p for p in parse_problems)
    assert any("cannot read test entry" in p for p in parse_problems)
    row_problems = check_registry_rows(rows, titles)
    assert any("missing [2]" in p and "unknown [3, 4]" in p for p in row_problems)
    rows[2] = Row(2, "Bet", "x", [("a.py", False)], [])
    assert any("title 'Bet'" in p for p in check_registry_rows(rows, titles))

    (tmp_path / "a.py").write_text("x = 1  # Detail 1: Alpha\n")
    sources = {
        "a.py": "x = 1  # Detail 1: Alpha\n",
        "c.py": "# Detail 1: Alpha\n# Detail 2: beta\n# Detail 2: Beta\n# Detail 9: Nine\n",
    }
    problems = "\n".join(check_tags(sources, rows, titles, tmp_path))
    assert "c.py:2: Detail 2 tagged 'beta'" in problems  # wrong title
    assert "c.py: Detail 2 tagged 2 times" in problems  # tagged twice in one file
    assert "c.py:1: tags Detail 1, but docs/details.md does not list c.py" in problems  # listed as planned
    assert "drop its '(planned)'" in problems
    assert "Detail 9 does not exist" in problems
    assert "Detail 1 lists b.py, which does not exist" in problems  # listed, not planned, absent
    assert "Detail 2 lists a.py, which carries no '# Detail 2:' tag" in problems  # listed, untagged
    assert "a.py:1" not in problems  # the one correct tag is not reported


# ---------------------------------------------------------------------------------------------
# b. Tests named in the registry exist
# ---------------------------------------------------------------------------------------------


def check_registry_tests(rows: dict[int, Row], repo: Path) -> list[str]:
    """Every `tests/<file>.py::<name>` of the registry names a file that defines `def <name>(`."""
    problems = []
    for n, row in sorted(rows.items()):
        for path, name in row.tests:
            file = repo / path
            if not file.is_file():
                problems.append(f"docs/details.md: Detail {n} names {path}::{name}, but {path} does not exist")
            elif not re.search(rf"\bdef {name}\(", file.read_text()):
                problems.append(f"docs/details.md: Detail {n} names {path}::{name}, but {path} defines no {name}")
    return problems


def test_registry_tests_exist():
    rows, problems = parse_registry(REGISTRY.read_text())
    problems += check_registry_tests(rows, REPO)
    assert not problems, "\n".join(problems)


def test_registry_test_checker_catches_missing_tests(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_here():\n    pass\n\ndef test_there_too():\n    pass\n")
    tests = [("tests/test_a.py", "test_here"), ("tests/test_a.py", "test_there"), ("tests/test_b.py", "test_x")]
    rows = {1: Row(1, "Alpha", "x", [], tests)}
    problems = check_registry_tests(rows, tmp_path)
    assert len(problems) == 2, problems
    assert "defines no test_there" in problems[0]  # a prefix of another test's name does not count
    assert "tests/test_b.py does not exist" in problems[1]


# ---------------------------------------------------------------------------------------------
# c. Every Args field has a docstring and is read
# ---------------------------------------------------------------------------------------------


def _is_dataclass_decorator(node: ast.expr) -> bool:
    """True for `@dataclass`, `@dataclasses.dataclass` and their called forms `@dataclass(...)`."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name == "dataclass"


def args_classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    """Every `@dataclass` class whose name ends with `Args`, at any depth -> its node."""
    return {
        node.name: node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and node.name.endswith("Args")
        and any(map(_is_dataclass_decorator, node.decorator_list))
    }


def _names_in(annotation: ast.expr) -> set[str]:
    """All identifiers in an annotation: `tyro.conf.Suppress[int]` -> {tyro, conf, Suppress, int}."""
    names = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(re.findall(r"\w+", node.value))  # string annotations
    return names


def dataclass_fields(cls: ast.ClassDef) -> list[tuple[ast.AnnAssign, bool]]:
    """The fields of a dataclass body -> [(annotated assignment, has a docstring right after)]."""
    fields = []
    for i, stmt in enumerate(cls.body):
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue  # methods, docstrings, plain class attributes
        if "ClassVar" not in _names_in(stmt.annotation):
            nxt = cls.body[i + 1] if i + 1 < len(cls.body) else None
            documented = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt.value, "value", None), str)
            fields.append((stmt, documented))
    return fields


def check_args_fields(source: str, filename: str) -> list[str]:
    """Every field of every `...Args` dataclass has a docstring and is read outside its class."""
    tree = ast.parse(source)
    classes = args_classes(tree)
    if not classes:
        return [f"{filename}: no `@dataclass class Args` (every stage script takes its flags from one)"]
    problems = []
    for cls in classes.values():
        inside = range(cls.lineno, cls.end_lineno + 1)
        read = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.lineno not in inside
        }
        for stmt, documented in dataclass_fields(cls):
            name = stmt.target.id
            if not documented:
                problems.append(f'{filename}:{stmt.lineno}: {cls.name}.{name} has no """docstring""" (its --help)')
            if name not in read:
                kind = "derived field" if "Suppress" in _names_in(stmt.annotation) else "flag"
                problems.append(
                    f"{filename}:{stmt.lineno}: {cls.name}.{name} is never read (no `.{name}` outside the class); "
                    f"remove the {kind}"
                )
    return problems


@pytest.mark.parametrize("script", CLI_SCRIPTS)
def test_args_fields_documented_and_read(script):
    problems = check_args_fields((REPO / script).read_text(), script)
    assert not problems, "\n".join(problems)


def test_args_checker_catches_undocumented_and_unread():
    source = textwrap.dedent('''\
        import dataclasses
        from dataclasses import dataclass, field
        from typing import ClassVar
        import tyro

        @dataclasses.dataclass
        class OptimArgs:
            lr: float = 3e-6
            """learning rate"""
            eps: float = 1e-5

        @dataclass(frozen=False)
        class Args:
            seed: int = 1
            """seed"""
            unused_flag: bool = False
            """never read"""
            optim: OptimArgs = field(default_factory=OptimArgs)
            """optimizer"""
            batch_size: tyro.conf.Suppress[int] = 0
            """derived, assigned but never read"""
            registry: ClassVar[dict] = {}

            def __post_init__(self):
                print(self.unused_flag)  # inside the class body: does not count

        if __name__ == "__main__":
            args = tyro.cli(Args)
            args.batch_size = 4
            print(args.seed, args.optim.lr, args.optim.eps)
        ''')
    problems = check_args_fields(source, "s.py")
    assert len(problems) == 3, problems
    assert "OptimArgs.eps has no" in problems[0]
    assert "Args.unused_flag is never read" in problems[1]
    assert "Args.batch_size is never read" in problems[2] and "derived field" in problems[2]
    assert "no `@dataclass class Args`" in check_args_fields("class Args:\n    x: int = 1\n", "t.py")[0]


# ---------------------------------------------------------------------------------------------
# d. Same-named top-level helpers agree across stage scripts
# ---------------------------------------------------------------------------------------------

# Copies compare as code: docstrings and comments may differ (a copy carries its Detail tag and its
# why-comments where its own stage acts, e.g. above or below its fence), statements may not.
# A copy may also be cut to what its stage uses (no branch for another stage's case); such a name is
# listed here with the test that runs its copies on the inputs they share and checks they agree.
AGREEING_COPIES: dict[str, str] = {  # name -> "tests/<file>.py::<test>"
    # ppo.py only loads the trained RM and scores with (B, T) padding masks: no head initialisation, no 4-D masks.
    "ScalarModel": "tests/test_ppo.py::test_scalar_model_copies_agree",
    # sft.py, reward.py and dpo.py load causal LMs only: no reward-model branch.
    "load_fp32": "tests/test_sft.py::test_a_model_folder_of_the_wrong_stage_is_named_before_it_loads",
    # reward.py runs no compiled layers: its last_layer_at takes no `layers`.
    "last_layer_at": "tests/test_ppo.py::test_last_layer_at_copies_agree",
    # PPO anneals its lr by hand: its checkpoint helpers carry no scheduler.
    **{name: "tests/test_ppo.py::test_checkpoint_copies_agree"
       for name in ("check_and_checkpoint", "resume", "save_checkpoint", "load_checkpoint")},
}


def _without_docstrings(node: ast.AST) -> ast.AST:
    """`node` with the docstring of every function and class in it dropped (comments never reach the AST)."""
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if (isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            sub.body = body[1:] or [ast.Pass()]
    return node


def top_level_definitions(source: str) -> dict[str, tuple[str, str]]:
    """Top-level functions and classes (not `main` nor the `...Args` dataclasses) -> (source text incl. decorators, code).

    The code is the syntax tree without docstrings, as ast.dump writes it (no line numbers)."""
    lines = source.splitlines()
    tree = ast.parse(source)
    exempt = set(args_classes(tree)) | {"main"}  # each script has its own flags and its own steps by design
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name not in exempt:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            text = "\n".join(lines[start - 1 : node.end_lineno])
            out[node.name] = (text, ast.dump(_without_docstrings(node)))
    return out


def _code_lines(text: str) -> list[str]:
    """The stripped lines of `text` that are neither blank nor comments (for a readable first difference)."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def check_shared_definitions(sources: dict[str, str], agreeing: dict[str, str] = AGREEING_COPIES,
                             repo: Path = REPO) -> list[str]:
    """A name defined at top level in several scripts must have the same code in all of them (docstrings and
    comments aside), unless `agreeing` names a test of that name's copies that exists."""
    by_name: dict[str, dict[str, list[tuple[str, str]]]] = {}  # name -> {code: [(file, source text)]}
    for path, source in sources.items():
        for name, (text, code) in top_level_definitions(source).items():
            by_name.setdefault(name, {}).setdefault(code, []).append((path, text))
    problems = []
    for name, versions in sorted(by_name.items()):
        if len(versions) < 2:
            continue
        if name in agreeing:
            test_path, _, test_name = agreeing[name].partition("::")
            test_file = repo / test_path
            if not (test_file.is_file() and re.search(rf"\bdef {test_name}\(", test_file.read_text())):
                problems.append(f"`{name}`: its copies differ and AGREEING_COPIES names {agreeing[name]}, "
                                "which does not exist: write the test that checks they agree")
            continue
        groups = " vs ".join("+".join(path for path, _ in copies) for copies in versions.values())
        first, second = (_code_lines(copies[0][1]) for copies in list(versions.values())[:2])
        diff = next((f"{a!r} / {b!r}" for a, b in zip(first, second) if a != b), "one is longer")
        problems.append(
            f"`{name}` differs between {groups} (first difference: {diff}); make the code the same, rename one, "
            "or cut copies to their stage's use and name a test of their agreement in AGREEING_COPIES"
        )
    return problems


def test_shared_helpers_agree():
    problems = check_shared_definitions(stage_sources(REPO))
    assert not problems, "\n".join(problems)


def test_shared_helper_checker_catches_drift():
    helper = "def whiten(x, shift_mean=True):\n    return x - x.mean()\n"
    args = "from dataclasses import dataclass\n@dataclass\nclass Args:\n    {}: int = 1\n"
    sources = {
        "a.py": args.format("a") + helper + "class Box:\n    pass\n",
        "b.py": args.format("b") + helper + "@final\nclass Box:\n    pass\n",
        "c.py": helper.replace("x.mean()", "x.mean(0)"),
    }
    problems = check_shared_definitions(sources)
    assert len(problems) == 2, problems  # Args differ by design and are not compared
    assert problems[0].startswith("`Box` differs between a.py vs b.py")  # a decorator counts
    assert problems[1].startswith("`whiten` differs between a.py+b.py vs c.py")
    assert "'return x - x.mean()' / 'return x - x.mean(0)'" in problems[1]
    # Docstrings and comments may differ (a Detail tag sits where its stage acts); a statement may not.
    commented = 'def whiten(x, shift_mean=True):\n    """Centre x."""\n    # Detail 25: ...\n    return x - x.mean()\n'
    assert check_shared_definitions({"a.py": helper, "d.py": commented}) == []
    assert len(check_shared_definitions({"a.py": helper, "e.py": commented.replace("x.mean()", "x.sum()")})) == 1
    assert len(check_shared_definitions({"a.py": helper, "f.py": commented.replace("return", "y = 1\n    return")})) == 1
    # Each script's `main` is its own steps, as its Args are its own flags: not compared.
    assert check_shared_definitions({"a.py": "def main():\n    return 1\n", "b.py": "def main():\n    return 2\n"}) == []


def test_shared_helper_checker_accepts_cut_copies_only_with_a_test(tmp_path):
    full = "def score(x, four_d=False):\n    if four_d:\n        x = x[:, None]\n    return x.sum()\n"
    cut = "def score(x):\n    return x.sum()\n"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_score_copies_agree():\n    pass\n")
    sources = {"a.py": full, "b.py": cut}
    assert len(check_shared_definitions(sources, {}, tmp_path)) == 1
    assert check_shared_definitions(sources, {"score": "tests/test_a.py::test_score_copies_agree"}, tmp_path) == []
    problems = check_shared_definitions(sources, {"score": "tests/test_a.py::test_score_agrees"}, tmp_path)
    assert len(problems) == 1 and "which does not exist" in problems[0]


def main_guard_code(source: str) -> Optional[str]:
    """The code of a script's `if __name__ == "__main__":` block (docstrings and comments dropped), None if none."""
    guards = [node for node in ast.parse(source).body if isinstance(node, ast.If)
              and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"']
    return ast.unparse(_without_docstrings(guards[-1])) if guards else None


def test_training_stages_start_and_end_the_same_way():
    """The training stages share their `__main__` block: the SetupError message, the finished run's re-push
    (--resume --push_to_hub) or "nothing to do", the process group's exit. Only sft.py's runs end to end
    (test_faults_kill.py); the others' blocks must be the same code."""
    blocks = {name: main_guard_code((REPO / name).read_text()) for name in ("sft.py", "reward.py", "dpo.py", "ppo.py")
              if (REPO / name).is_file()}
    assert all(blocks.values()), [name for name, block in blocks.items() if not block]
    assert len(set(blocks.values())) == 1, {name: block.splitlines() for name, block in blocks.items()}
    flipped = (REPO / "sft.py").read_text().replace('if done.flags["push_to_hub"]', 'if not done.flags["push_to_hub"]')
    assert main_guard_code(flipped) != blocks["sft.py"]  # the comparison sees such a change
    # The push at the end of training, in each stage's own save function: the same call (sft.py's is run end to end)
    pushes = {name: re.findall(r"^ +(push_to_hub\(args\.output_dir, .*\))$", (REPO / name).read_text(), re.M)
              for name in blocks}
    assert all(len(calls) == 1 for calls in pushes.values()) and len({calls[0] for calls in pushes.values()}) == 1, (
        pushes)


# ---------------------------------------------------------------------------------------------
# e. Importing a stage script runs nothing
# ---------------------------------------------------------------------------------------------


def has_main_guard(source: str) -> bool:
    """True when the module has a top-level `if __name__ == "__main__":`."""
    for node in ast.parse(source).body:
        test = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__"
        ):
            return True
    return False


def _run(cmd: list[str], workdir: Path) -> subprocess.CompletedProcess | None:
    """Run `cmd` in `workdir` with the test environment (offline, see conftest.py); None on timeout.

    Wide and colourless so that --help prints each flag whole; no bytecode written beside the scripts (conftest.py).
    """
    env = {**os.environ, **HELP_ENV}
    try:
        return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def check_imports_are_inert(scripts: list[Path], workdirs: list[Path]) -> list[list[str]]:
    """For each script: `import <module>` from its empty workdir succeeds, prints nothing, writes nothing there.
    All imports run in one fresh interpreter (conftest.early_exits), one after the other."""
    shim = workdirs[0].parent / "import_module.py"  # `python import_module.py FOLDER MODULE`: beside the workdirs
    shim.write_text("import importlib, sys\nsys.path.insert(0, sys.argv[1])\nimportlib.import_module(sys.argv[2])\n")
    try:
        starts = [(workdir, shim, [script.parent, script.stem]) for script, workdir in zip(scripts, workdirs)]
        results = early_exits(starts, env={**os.environ, **HELP_ENV}, timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        shim.unlink()
    all_problems = []
    for script, workdir, proc in zip(scripts, workdirs, results):
        problems = [] if has_main_guard(script.read_text()) else [f'{script.name}: no `if __name__ == "__main__":` block']
        if proc.returncode != 0:
            problems.append(f"{script.name}: import failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        if proc.stdout:
            problems.append(f"{script.name}: import printed to stdout: {proc.stdout[:500]!r}")
        created = sorted(p.name for p in workdir.iterdir())
        if created:
            problems.append(f"{script.name}: import created {created} in the working directory")
        all_problems.append(problems)
    return all_problems


@pytest.fixture(scope="module")
def import_problems(tmp_path_factory):
    """{script: its problems from check_imports_are_inert}, for every CLI script, in one interpreter."""
    root = tmp_path_factory.mktemp("imports")
    workdirs = [root / script for script in CLI_SCRIPTS]
    for workdir in workdirs:
        workdir.mkdir()
    return dict(zip(CLI_SCRIPTS, check_imports_are_inert([REPO / script for script in CLI_SCRIPTS], workdirs)))


@pytest.mark.parametrize("script", CLI_SCRIPTS)
def test_import_runs_nothing(script, import_problems):
    problems = import_problems[script]
    assert not problems, "\n".join(problems)


def test_import_checker_catches_side_effects(tmp_path):
    (tmp_path / "src").mkdir()
    for cwd in ("cwd1", "cwd2", "cwd3"):  # one empty working directory per import
        (tmp_path / cwd).mkdir()
    noisy = tmp_path / "src" / "noisy_stage.py"
    noisy.write_text('print("loading")\nopen("cache.txt", "w").write("x")\n')
    broken = tmp_path / "src" / "broken_stage.py"
    broken.write_text('raise RuntimeError("boom")\nif __name__ == "__main__":\n    pass\n')
    quiet = tmp_path / "src" / "quiet_stage.py"
    quiet.write_text('import os\n\nif __name__ == "__main__":\n    print("run")\n')
    problems, broken_problems, quiet_problems = check_imports_are_inert(
        [noisy, broken, quiet], [tmp_path / "cwd1", tmp_path / "cwd2", tmp_path / "cwd3"])
    assert len(problems) == 3, problems
    assert "no `if __name__" in problems[0]
    assert "printed to stdout" in problems[1]
    assert "created ['cache.txt']" in problems[2]
    assert "RuntimeError: boom" in "\n".join(broken_problems)
    assert quiet_problems == []


# ---------------------------------------------------------------------------------------------
# f. `--help` exits 0 and lists every flag
# ---------------------------------------------------------------------------------------------


def expected_flags(source: str) -> list[str]:
    """The flags tyro should show for the script's Args: `field`, or `parent.field` when nested.

    Roots are the `...Args` dataclasses no other one nests; `tyro.conf.Suppress` fields are not flags.
    """
    classes = args_classes(ast.parse(source))
    annotations = [stmt.annotation for cls in classes.values() for stmt, _ in dataclass_fields(cls)]
    nested_in = set().union(*(_names_in(a) & set(classes) for a in annotations))

    def flags(cls: ast.ClassDef, prefix: str) -> list[str]:
        out = []
        for stmt, _ in dataclass_fields(cls):
            names = _names_in(stmt.annotation)
            if "Suppress" in names:
                continue
            sub = sorted(names & set(classes))
            out += flags(classes[sub[0]], f"{prefix}{stmt.target.id}.") if sub else [prefix + stmt.target.id]
        return out

    return [flag for name, cls in classes.items() if name not in nested_in for flag in flags(cls, "")]


def check_help_lists_flags(script: Path, workdir: Path, result: dict | None = None) -> list[str]:
    """`python <script> --help` exits 0 and shows `--<flag>` for each field, with underscores as the README, the
    error messages and the launchers write it (tyro's `use_underscores=True`; tyro reads dashes too).
    `result`: that run's {returncode, stdout, stderr} if already made (conftest's `script_help`)."""
    if result is None:
        proc = _run([sys.executable, str(script), "--help"], workdir)
        if proc is None:
            return [f"{script.name} --help did not finish in {SUBPROCESS_TIMEOUT_S} s"]
        result = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    if result["returncode"] != 0:
        return [f"{script.name} --help exited {result['returncode']}:\n{result['stderr'][-3000:]}"]
    text = re.sub(r"\x1b\[[0-9;]*m", "", result["stdout"] + result["stderr"])  # drop colour codes, if any
    problems = []
    for flag in expected_flags(script.read_text()):
        if not re.search("--" + re.escape(flag) + r"(?![\w.-])", text):
            problems.append(f"{script.name} --help does not show --{flag}")
    return problems


@pytest.mark.parametrize("script", CLI_SCRIPTS)
def test_help_lists_every_flag(script, tmp_path, script_help):
    problems = check_help_lists_flags(REPO / script, tmp_path, script_help(REPO / script))
    assert not problems, "\n".join(problems)


def test_help_checker_catches_missing_flags(tmp_path):
    header = textwrap.dedent('''\
        from dataclasses import dataclass, field
        import tyro

        @dataclass
        class OptimArgs:
            learning_rate: float = 3e-6
            """learning rate"""

        @dataclass
        class Args:
            exp_name: str = "x"
            """run name"""
            track: bool = False
            """track with wandb"""
            optim: OptimArgs = field(default_factory=OptimArgs)
            """optimizer"""
            batch_size: tyro.conf.Suppress[int] = 0
            """derived"""

        ''')
    assert expected_flags(header) == ["exp_name", "track", "optim.learning_rate"]
    good = tmp_path / "good.py"  # real tyro: nested, boolean and suppressed fields are matched
    good.write_text(header + 'if __name__ == "__main__":\n    args = tyro.cli(Args, use_underscores=True)\n')
    assert check_help_lists_flags(good, tmp_path) == []
    dashed = tmp_path / "dashed.py"  # tyro's default help: --exp-name, not the docs' --exp_name
    dashed.write_text(header + 'if __name__ == "__main__":\n    args = tyro.cli(Args)\n')
    problems = check_help_lists_flags(dashed, tmp_path)
    assert [p.split("does not show ")[1] for p in problems] == ["--exp_name", "--optim.learning_rate"], problems
    hand_rolled = tmp_path / "hand_rolled.py"  # a help text that forgets two flags
    hand_rolled.write_text(header + 'if __name__ == "__main__":\n    print("usage: [--exp_name STR] [--track_all]")\n')
    problems = check_help_lists_flags(hand_rolled, tmp_path)
    assert len(problems) == 2, problems
    assert problems[0].endswith("does not show --track") and "--optim.learning_rate" in problems[1]
    failing = tmp_path / "failing.py"
    failing.write_text(header + 'if __name__ == "__main__":\n    raise SystemExit(3)\n')
    assert "--help exited 3" in check_help_lists_flags(failing, tmp_path)[0]


# ---------------------------------------------------------------------------------------------
# g. Every path the README and the manuals beside it name exists
# ---------------------------------------------------------------------------------------------

PATHLIKE_SUFFIXES = (".py", ".sh", ".md", ".txt", ".yaml", ".yml", ".json", ".png")
REQUIRED_SUFFIXES = (".py", ".sh", ".md", ".txt", ".yaml", ".yml")  # repository file types
# Written at run time, never committed (plus the root entries that .gitignore anchors, e.g. /tiny_world/).
GENERATED_DIRS = {"data", "runs", "models", "output", "wandb"}


def readme_paths(text: str) -> list[str]:
    """Path-like tokens of a README: in `inline code`, fenced code blocks and [link](targets)."""
    tokens = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced:
            tokens += line.split()
        else:
            tokens += [t for span in re.findall(r"`([^`]+)`", line) for t in span.split()]
            tokens += re.findall(r"\]\(([^)\s]+)\)", line)
    paths = []
    for token in tokens:
        if "://" in token:
            continue  # a URL
        token = token.split("=", 1)[1] if "=" in token else token  # --flag=path, VAR=path
        token = token.strip("\"'()[]{},;:")
        token = re.sub(r"(::\w.*|:\d+|#.*)$", "", token)  # tests/x.py::test_y, file.py:12, doc.md#anchor
        if (
            not token
            or token.startswith(("-", "/", "~", "www."))
            or any(c in token for c in "$<>{}?@|\\")
            or not ("/" in token or token.endswith(PATHLIKE_SUFFIXES))
        ):
            continue
        paths.append(token)
    return paths


def check_readme_paths(text: str, repo: Path, doc: str = "README.md") -> list[str]:
    """Paths under an existing top-level entry, or with a repository file type, must exist.

    `doc`: the document's path in the repository. A path it names may be written from the repository's root or
    from the document's own folder (benchmark/README.md names `tiny.sh` and `results/sampling.md`).
    Exempt: run-time outputs (data/, runs/, models/, output/, wandb/, anchored .gitignore entries),
    Hub ids (`Org/name`: no file type, first part not a top-level entry), other artifacts (`args.json`).
    """
    bases = list(dict.fromkeys((repo, (repo / doc).parent)))
    top = {p.name for base in bases for p in base.iterdir()} - {".git"}
    gitignore = repo / ".gitignore"
    anchored = re.findall(r"^/([^/\s*]+)/?\s*$", gitignore.read_text(), re.M) if gitignore.is_file() else []
    generated = GENERATED_DIRS | set(anchored)
    problems = []
    for path in dict.fromkeys(readme_paths(text)):  # unique, in order
        parts = Path(path.removeprefix("./")).parts
        if not parts or parts[0] in generated or not (parts[0] in top or path.endswith(REQUIRED_SUFFIXES)):
            continue
        relative = path.removeprefix("./")
        if not any(any(base.glob(relative)) if "*" in path else (base / relative).exists() for base in bases):
            problems.append(f"{doc} names {path}, which does not exist")
    return problems


def test_readme_paths_exist():
    assert README.is_file(), "README.md is missing"
    problems = check_readme_paths(README.read_text(), REPO)
    assert not problems, "\n".join(problems)


# The manuals beside the README (not the dated records under benchmark/results/, which keep the names of their day).
MANUALS = ("benchmark/README.md", "docs/details.md")


@pytest.mark.parametrize("doc", MANUALS)
def test_manual_paths_exist(doc):
    assert (REPO / doc).is_file(), f"{doc} is missing"
    problems = check_readme_paths((REPO / doc).read_text(), REPO, doc)
    assert not problems, "\n".join(problems)


def test_readme_checker_catches_missing_paths(tmp_path):
    (tmp_path / "benchmark").mkdir()
    (tmp_path / "benchmark" / "launch_sft.sh").write_text("")
    (tmp_path / "sft.py").write_text("")
    (tmp_path / ".gitignore").write_text("/tiny_world/\n")
    readme = textwrap.dedent("""\
        Run `python sft.py --output_dir=models/sft`, read `models/sft/args.json`, see [it](benchmark/launch_sft.sh).
        The model is `EleutherAI/pythia-1b-deduped`; the paper: https://arxiv.org/abs/2403.17031, `https://x.org/a.py`.
        Outputs land in `tiny_world/sft` and `data/tldr`; `sft.py:12` and `sft.py::main` and `benchmark/*.sh` are fine.

        ```bash
        bash benchmark/launch_ppo.sh --config=benchmark/zero2.yaml
        python dpo.py
        ```
        See [the registry](docs/details.md#detail-3) and `reward.py`.
        """)
    problems = sorted(check_readme_paths(readme, tmp_path))
    assert problems == [
        "README.md names benchmark/launch_ppo.sh, which does not exist",
        "README.md names benchmark/zero2.yaml, which does not exist",
        "README.md names docs/details.md, which does not exist",
        "README.md names dpo.py, which does not exist",
        "README.md names reward.py, which does not exist",
    ], problems
    # A manual in a subfolder may name paths from its own folder as well as from the root.
    (tmp_path / "benchmark" / "results").mkdir()
    (tmp_path / "benchmark" / "results" / "sampling.md").write_text("")
    manual = ("Run `bash launch_sft.sh`, then `benchmark/launch_sft.sh` again; "
              "read `results/sampling.md`, `results/gone.md`, `run.sh`.")
    problems = check_readme_paths(manual, tmp_path, "benchmark/README.md")
    assert problems == ["benchmark/README.md names results/gone.md, which does not exist",
                        "benchmark/README.md names run.sh, which does not exist"], problems


# ---------------------------------------------------------------------------------------------
# h. The algorithm above one fence, plumbing and fast paths below
# ---------------------------------------------------------------------------------------------

FENCE = "# ---- plumbing and fast paths: no Detail below ----"
# Every stage (../shared/STYLE.md): the training stages, the preprocessing and the judge.
FENCED_STAGES = ("preprocess_tldr.py", "sft.py", "reward.py", "dpo.py", "ppo.py", "judge.py")


def check_fence(source: str, filename: str) -> list[str]:
    """One fence line; `def main()` above it and no Detail tag below it; every fast path (a top-level function or
    class whose docstring opens with `==`, the plain expression it equals) below it; `main()` run by the last
    statement, the `if __name__ == "__main__":` block (once every helper below the fence is defined)."""
    lines = source.splitlines()
    fences = [lineno for lineno, line in enumerate(lines, 1) if line == FENCE]
    if len(fences) != 1:
        return [f"{filename}: {len(fences)} lines `{FENCE}`, want exactly one"]
    fence = fences[0]
    problems = [f"{filename}:{lineno}: Detail {n} tagged below the fence (line {fence}); tag it where it acts, above"
                for lineno, n, _ in find_tags(source) if lineno > fence]
    body = ast.parse(source).body
    definitions = [node for node in body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    if not any(node.name == "main" and node.lineno < fence for node in definitions):
        problems.append(f"{filename}: no `def main()` above the fence (line {fence})")
    for node in definitions:
        docstring = ast.get_docstring(node) or ""
        if docstring.startswith("==") and node.lineno < fence:
            problems.append(f"{filename}:{node.lineno}: fast path `{node.name}` above the fence; move it below")
    runs_main = body and has_main_guard(ast.unparse(body[-1])) and any(
        isinstance(node, ast.Call) and getattr(node.func, "id", None) == "main" for node in ast.walk(body[-1]))
    if not runs_main:
        problems.append(f"{filename}: the last statement is not an `if __name__ == \"__main__\":` block that runs main()")
    return problems


def test_every_script_these_checks_list_exists():
    """The checks run over the scripts that exist: a stage renamed or removed would lose them silently."""
    listed = set(STAGE_SCRIPTS + TOOL_SCRIPTS + FENCED_STAGES + SIZED_SCRIPTS)
    assert sorted(name for name in listed if not (REPO / name).is_file()) == []


@pytest.mark.parametrize("script", [name for name in FENCED_STAGES if (REPO / name).is_file()])
def test_algorithm_above_the_fence(script):
    problems = check_fence((REPO / script).read_text(), script)
    assert not problems, "\n".join(problems)


def test_fence_checker_catches_misplaced_code():
    good = textwrap.dedent(f'''\
        def step(x):
            """One step."""
            # Detail 1: Alpha
            return fast(x)


        def main():
            step(1)


        {FENCE}


        def fast(x):
            """== x + 0, faster."""
            return x


        if __name__ == "__main__":
            main()
        ''')
    assert check_fence(good, "a.py") == []
    assert "2 lines" in check_fence(good + FENCE + "\n", "b.py")[0]
    misplaced = good.replace("def step(x):", "def early(x):\n    \"\"\"== x.\"\"\"\n\n\ndef step(x):")
    misplaced = misplaced.replace("    return x\n", "    # Detail 2: Beta\n    return x\n").replace("def main", "def mane")
    problems = "\n".join(check_fence(misplaced + "print(1)\n", "c.py"))
    assert "Detail 2 tagged below the fence" in problems and "Detail 1" not in problems
    assert "no `def main()` above the fence" in problems
    assert "fast path `early` above the fence" in problems and "`fast`" not in problems
    assert "the last statement is not an `if __name__" in problems
    teardown = good.replace("\n    main()\n", "\n    try:\n        main()\n    finally:\n        pass\n")
    assert teardown != good
    assert check_fence(teardown, "d.py") == []  # main() inside a try / finally still runs last


# Sizes a reading takes in (issue 18): the algorithm above the fence in so many lines (the fence line itself not
# counted); no function longer than FUNCTION_LINES but `main()`, the paper's steps, at most MAIN_LINES; a loop of a
# `main()` (ppo.py's training loop) at most LOOP_LINES below its `for` / `while` line.
ABOVE_FENCE_LINES = {"sft.py": 350, "reward.py": 450, "dpo.py": 450, "ppo.py": 550}
FUNCTION_LINES, MAIN_LINES, LOOP_LINES = 60, 250, 80
SIZED_SCRIPTS = FENCED_STAGES + ("tiny_world.py",)


def check_sizes(source: str, filename: str, above_fence: Optional[int] = None) -> list[str]:
    """The lines above the fence (if `above_fence`), every function's lines (def to last line, nested ones too) and
    the loops of `main()` against the limits above."""
    lines, problems = source.splitlines(), []
    if above_fence is not None and FENCE in lines and lines.index(FENCE) > above_fence:
        problems.append(f"{filename}: {lines.index(FENCE)} lines above the fence, at most {above_fence}: move "
                        "plumbing below it or say the algorithm in fewer lines")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length, limit = node.end_lineno - node.lineno + 1, MAIN_LINES if node.name == "main" else FUNCTION_LINES
        if length > limit:
            problems.append(f"{filename}:{node.lineno}: `{node.name}` has {length} lines, at most {limit}: name its "
                            "steps as functions")
        loops = [loop for loop in ast.walk(node) if isinstance(loop, (ast.For, ast.While))] if node.name == "main" else []
        problems += [f"{filename}:{loop.lineno}: a loop of `main` has a body of {loop.end_lineno - loop.lineno} lines, "
                     f"at most {LOOP_LINES}" for loop in loops if loop.end_lineno - loop.lineno > LOOP_LINES]
    return problems


@pytest.mark.parametrize("script", [name for name in SIZED_SCRIPTS if (REPO / name).is_file()])
def test_scripts_read_in_sizes_a_reader_takes_in(script):
    problems = check_sizes((REPO / script).read_text(), script, ABOVE_FENCE_LINES.get(script))
    assert not problems, "\n".join(problems)


def test_size_checker_catches_long_code():
    def function(name, lines, loop=0):
        body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2 - (loop and loop + 1)))
        body += "    for _ in range(2):\n" + "".join(f"        y{i} = {i}\n" for i in range(loop)) if loop else ""
        return f"def {name}():\n{body}    return 0\n\n\n"

    fits = function("step", 60) + function("main", 250, loop=80) + FENCE + "\n" + function("fast", 60)
    assert check_sizes(fits, "a.py", above_fence=314) == []  # 60 + 250 lines and two blank lines after each
    assert [problem.split(": ", 1)[1] for problem in check_sizes(fits, "a.py", above_fence=313)] == [
        "314 lines above the fence, at most 313: move plumbing below it or say the algorithm in fewer lines"]
    long = function("step", 61) + function("main", 251, loop=81) + "class Sampler:\n" + "".join(
        "    " + line + "\n" for line in function("__call__", 61).splitlines())
    assert [problem.split(": ", 1)[1] for problem in check_sizes(long, "b.py")] == [
        "`step` has 61 lines, at most 60: name its steps as functions",
        "`main` has 251 lines, at most 250: name its steps as functions",
        "a loop of `main` has a body of 81 lines, at most 80",
        "`__call__` has 61 lines, at most 60: name its steps as functions"]




# ---------------------------------------------------------------------------------------------
# i. The front page's tiny-world command is the one benchmark/tiny.sh runs
# ---------------------------------------------------------------------------------------------

# Stages whose module docstring shows a `# tiny world` command (judge.py's example is generic).
TINY_COMMAND_STAGES = ("preprocess_tldr.py", "sft.py", "reward.py", "dpo.py", "ppo.py")
# Flags tiny.sh passes for its own bookkeeping, which a reader's run need not copy: the PPO run's name,
# which its report reads the evaluation curve from, and the checkpoints that let a second start continue.
BOOKKEEPING_FLAGS = {"--run_name", "--save_every", "--resume"}


def tiny_sh_commands(repo: Path, scratch: Path) -> list[list[str]]:
    """The `python ...` commands of benchmark/tiny.sh on the committed world, its variables at their defaults.

    tiny.sh runs in `scratch`, a copy of its folder layout, with `python` a shell function that records its
    arguments: nothing runs and nothing outside `scratch` is touched (tiny.sh removes a runs/ folder)."""
    (scratch / "benchmark").mkdir(parents=True)
    (scratch / "benchmark" / "tiny.sh").write_text((repo / "benchmark" / "tiny.sh").read_text())
    (scratch / "assets" / "tiny_world").mkdir(parents=True)
    (scratch / "assets" / "tiny_world" / "world.json").write_text("{}")  # built: tiny.sh skips the build
    log = scratch / "python_calls"
    record = 'python() { printf "%s\\0" "$@" "--end--" >> "$CALLS"; }; export -f python; bash benchmark/tiny.sh'
    subprocess.run(["bash", "-c", record], cwd=scratch, check=True, capture_output=True, timeout=SUBPROCESS_TIMEOUT_S,
                   env={"PATH": os.environ["PATH"], "HOME": str(scratch), "CALLS": str(log)})
    commands, command = [], []
    for arg in log.read_text().split("\0")[:-1]:
        if arg == "--end--":
            commands.append(command)
            command = []
        else:
            command.append(arg)
    return commands


def docstring_tiny_command(source: str) -> list[str]:
    """The command under the `# tiny world` comment of a script's module docstring, as arguments after `python`."""
    lines = (ast.get_docstring(ast.parse(source)) or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("# tiny world")), None)
    if start is None:
        return []
    command = ""
    for line in lines[start + 1:]:
        if line.strip().startswith("#"):
            continue  # the comment's own continuation lines
        command += line.strip().removesuffix("\\")
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(command)[1:]  # without `python`


def flag_values(args: list[str]) -> dict[str, tuple]:
    """[script, --flag, value, ..., --switch, ...] -> {--flag: (value, ...), --switch: ()}; values before the first
    flag under None."""
    flags, flag = {}, None
    for arg in args[1:]:
        if arg.startswith("--"):
            flag = arg
            flags[flag] = ()
        else:
            flags[flag] = flags.get(flag, ()) + (arg,)
    return flags


def shown_value(values: Optional[tuple]) -> str:
    """A flag's values as a message shows them: `(absent)`, `(set)` for a switch, else the values."""
    return "(absent)" if values is None else " ".join(values) or "(set)"


def check_tiny_commands(sources: dict[str, str], commands: list[list[str]]) -> list[str]:
    """Each script's docstring command must pass the flags of one of tiny.sh's commands for that script, no more, no
    less (BOOKKEEPING_FLAGS aside, in any order): a reader who runs the front pages one by one runs the main job."""
    problems = []
    for script, source in sources.items():
        shown = docstring_tiny_command(source)
        if not shown:
            problems.append(f"{script}: no `# tiny world` command in its module docstring")
            continue
        if shown[0] != script:
            problems.append(f"{script}: its docstring's tiny-world command runs {shown[0]}")
            continue
        shown_flags = {k: v for k, v in flag_values(shown).items() if k not in BOOKKEEPING_FLAGS}
        runs = [{k: v for k, v in flag_values(c).items() if k not in BOOKKEEPING_FLAGS} for c in commands
                if c and c[0] == script]
        if not runs:
            problems.append(f"{script}: benchmark/tiny.sh never runs it")
        elif shown_flags not in runs:
            run = min(runs, key=lambda flags: len(set(flags.items()) ^ set(shown_flags.items())))
            differences = [f"{flag} {shown_value(shown_flags.get(flag))} in the docstring, "
                           f"{shown_value(run.get(flag))} in tiny.sh"
                           for flag in sorted(set(shown_flags) | set(run)) if shown_flags.get(flag) != run.get(flag)]
            problems.append(f"{script}: its docstring's tiny-world command is not tiny.sh's: " + "; ".join(differences))
    return problems


def test_front_pages_run_the_main_job(tmp_path):
    commands = tiny_sh_commands(REPO, tmp_path)
    assert [c[0] for c in commands if c[0].endswith(".py")][:2] == ["preprocess_tldr.py", "sft.py"], commands
    sources = {name: (REPO / name).read_text() for name in TINY_COMMAND_STAGES}
    problems = check_tiny_commands(sources, commands)
    assert not problems, "\n".join(problems)


def test_tiny_command_checker_catches_drift():
    commands = [["-c", "print(1)"], ["sft.py", "--lr", "2e-3", "--seed", "1", "--fast"],
                ["sft.py", "--lr", "2e-3", "--total_episodes", "0"], ["ppo.py", "--lr", "1e-4", "--run_name", "x"]]
    page = ('"""Doc.\n\n    # tiny world, offline\n    python {} \\\n        {}\n'
            '    # another\n    python {} --lr 9\n"""\n')
    sources = {
        "sft.py": page.format("sft.py", "--seed 1 --lr 2e-3 --fast", "sft.py"),  # tiny.sh's first sft.py, reordered
        "ppo.py": page.format("ppo.py", "--lr 1e-4", "ppo.py"),  # --run_name is bookkeeping
    }
    assert check_tiny_commands(sources, commands) == []
    assert flag_values(["x.py", "a", "--b", "1", "2", "--c"]) == {None: ("a",), "--b": ("1", "2"), "--c": ()}
    drifted = {
        "sft.py": page.format("sft.py", "--seed 1 --lr 3e-3", "sft.py"),
        "ppo.py": page.format("dpo.py", "--lr 1e-4", "dpo.py"),
        "dpo.py": page.format("dpo.py", "--lr 1e-4", "dpo.py"),
        "reward.py": '"""Doc without a command."""\n',
    }
    problems = check_tiny_commands(drifted, commands)
    assert problems == [
        "sft.py: its docstring's tiny-world command is not tiny.sh's: "
        "--fast (absent) in the docstring, (set) in tiny.sh; --lr 3e-3 in the docstring, 2e-3 in tiny.sh",
        "ppo.py: its docstring's tiny-world command runs dpo.py",
        "dpo.py: benchmark/tiny.sh never runs it",
        "reward.py: no `# tiny world` command in its module docstring",
    ], problems


# ---- j. documented commands use flags their scripts have ----

DOCUMENTS = ("README.md", "benchmark/README.md", "docs/details.md")


def script_flags(source: str) -> dict:
    """{flag name: whether it is a bool} of the `Args` dataclass of a script's source."""
    cls = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "Args")
    return {stmt.target.id: ast.unparse(stmt.annotation) == "bool" for stmt, _ in dataclass_fields(cls)}


def documented_commands(text: str) -> list:
    """[(line number, script file, [tokens after it])] of every `python X.py ...` / `accelerate launch ... X.py ...`
    of a stage or tool script in `text` (lines joined at trailing backslashes; `$NAME` expanded where the text sets
    NAME="..."; what follows `#`, a backtick, `;`, `&&`, `|` or `>` cut off)."""
    scripts = "|".join(re.escape(name) for name in CLI_SCRIPTS)
    variables = dict(re.findall(r'^\s*(\w+)="([^"]*)"', text, re.M))
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        match = re.search(rf"(?:python3? |accelerate launch .*?)(?:\S*/)?({scripts})((?: +\S+)*)", line)
        if match:
            rest = re.split(r" #|`|;|&&|\||>", match.group(2))[0]
            tokens = []
            for token in shlex.split(rest):
                name = token.strip("${}") if token.startswith("$") else None
                tokens += shlex.split(variables[name]) if name in variables else [token]
            found.append((start + 1, match.group(1), tokens))
    return found


def check_documented_commands(documents: dict, flags_of: dict) -> list:
    """Problems of the commands in `documents` ({name: text}) against `flags_of` ({script: script_flags})."""
    problems = []
    for document, text in documents.items():
        for line, script, tokens in documented_commands(text):
            flags = flags_of[script]
            for i, token in enumerate(tokens):
                if not token.startswith("--"):
                    continue  # a flag's value, or more of them (--tables a=x b=y)
                name = token[2:].split("=")[0].replace("-", "_")
                is_bool = flags.get(name[3:] if name.startswith("no_") and name not in flags else name)
                if is_bool is None:
                    problems.append(f"{document}:{line}: {script} has no flag {token}")
                elif is_bool and "=" not in token and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                    problems.append(f"{document}:{line}: {script} {token} is a switch, given the value {tokens[i + 1]}")
                elif not is_bool and "=" not in token and (i + 1 == len(tokens) or tokens[i + 1].startswith("--")):
                    problems.append(f"{document}:{line}: {script} {token} wants a value")
    return problems


def test_documented_commands_use_flags_their_scripts_have():
    flags_of = {name: script_flags((REPO / name).read_text()) for name in CLI_SCRIPTS}
    documents = {name: (REPO / name).read_text() for name in DOCUMENTS}
    documents.update({name: ast.get_docstring(ast.parse((REPO / name).read_text())) for name in CLI_SCRIPTS})
    assert sum(len(documented_commands(text)) for text in documents.values()) >= 30  # the checker sees them
    problems = check_documented_commands(documents, flags_of)
    assert not problems, "\n".join(problems)


def test_documented_command_checker_catches_drift():
    flags_of = {"sft.py": {"lr": False, "track": True, "seed": False}}
    good = 'B="--seed 1"\npython sft.py $B --lr 3e-6 --track  # a comment --nope\n'
    assert documented_commands(good) == [(2, "sft.py", ["--seed", "1", "--lr", "3e-6", "--track"])]
    assert check_documented_commands({"d": good}, flags_of) == []
    bad = ("accelerate launch --num_processes 8 sft.py --learning_rate 3e-6 \\\n    --seed\n"
           "python sft.py --track yes --no_track --lr\n")
    assert check_documented_commands({"d": bad}, flags_of) == [
        "d:1: sft.py has no flag --learning_rate", "d:1: sft.py --seed wants a value",
        "d:3: sft.py --track is a switch, given the value yes", "d:3: sft.py --lr wants a value"]


def test_test_order_names_existing_files():
    """conftest.FILE_SECONDS orders the test files for .ci/run's workers: a renamed or deleted file must leave it."""
    from conftest import FILE_SECONDS

    missing = sorted(name for name in FILE_SECONDS if not (REPO / "tests" / name).is_file())
    assert not missing, f"tests/conftest.py's FILE_SECONDS names test files that do not exist: {missing}"


# ---- k. every scalar ppo.py logs is placed beside the reference's in docs/details.md ----

# A researcher overlays our PPO curves on the paper's W&B runs: each name ppo.py logs needs its row in
# docs/details.md's table (the reference's name, how the two relate), and no row may name a scalar that is gone.
CURVES_SECTION = "## Reading our curves beside the paper's W&B runs"
LOGGED_NAME = re.compile(r"(?:objective|policy|value|time)/[a-z_0-9]+")


def logged_scalar_names(source: str) -> set[str]:
    """The string constants of `source` that are whole scalar names (objective/..., policy/..., value/..., time/...)."""
    return {node.value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and LOGGED_NAME.fullmatch(node.value)}


def check_curve_table(logged: set[str], doc: str) -> list[str]:
    """Every name in `logged` in the first column of the PPO table under CURVES_SECTION of `doc`, and only those."""
    if CURVES_SECTION not in doc:
        return [f"docs/details.md has no section {CURVES_SECTION!r}"]
    section = doc.split(CURVES_SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ours")]
    documented = {name for row in rows for name in re.findall(r"`([^`]+)`", row.split(" | ", 1)[0])
                  if LOGGED_NAME.fullmatch(name)}  # not eval/ppo/{split}/..., logged under a split's name
    return ([f"ppo.py logs {name}, which the table does not place beside the reference's"
             for name in sorted(logged - documented)]
            + [f"the table's first column names {name}, which ppo.py does not log"
               for name in sorted(documented - logged)])


def test_every_ppo_scalar_is_placed_beside_the_references():
    logged = logged_scalar_names((REPO / "ppo.py").read_text())
    assert {"objective/kl", "policy/approxkl", "value/loss", "time/training"} <= logged  # the checker sees them
    problems = check_curve_table(logged, (REPO / "docs" / "details.md").read_text())
    assert not problems, "\n".join(problems)


def test_curve_table_checker_catches_drift():
    source = 'stats = {"objective/kl": 1, "policy/new": 2}\nlabel = "objective/kl is shown"\n'
    assert logged_scalar_names(source) == {"objective/kl", "policy/new"}
    doc = (f"{CURVES_SECTION}\n\n| ours | the reference's | how |\n|---|---|---|\n"
           "| `objective/kl`, `value/gone` | `objective/kl` | same |\n| | `ppo/val/ratio_var` | not logged |\n"
           "| `eval/ppo/{split}/score` | | ours only: a split's name, not checked |\n"
           "\n## Next\n| `policy/new` | | outside the section |\n")
    assert check_curve_table(logged_scalar_names(source), doc) == [
        "ppo.py logs policy/new, which the table does not place beside the reference's",
        "the table's first column names value/gone, which ppo.py does not log"]
    assert check_curve_table(set(), "no such section") == [f"docs/details.md has no section {CURVES_SECTION!r}"]
