"""The command blocks of README.md and docs/*.md, and how CI runs them (tests/test_doc_commands.py).

Every shell block (```bash, ```sh, ```shell) carries a marker on the line before its fence, an HTML comment that
the rendered page does not show:

    <!-- ci: run -->                                   runs as written
    <!-- ci: run; append --training.steps 4 -->        runs with these keys appended to every ./run_train.sh,
                                                       torchtrain.train and torchtrain.tools.parity command of the
                                                       block (sizes and steps only)
    <!-- ci: run; after set-up -->                     its `python -m venv ... && pip install ... && ` prefix is the
                                                       set-up .ci/run performs before the suite: the rest runs
    <!-- ci: run; fresh -->                            runs in a scratch folder of its own: it needs nothing an earlier
                                                       block of the file wrote (CI runs it beside them)
    <!-- ci: run; check NAME -->                       then the check NAME of tests/test_doc_commands.py reads what
                                                       the block wrote and holds the figures its text states; in a
                                                       chain with appended keys (fewer steps) CI checks what holds
                                                       at any length, and the nightly run (`-m nightly`) runs the
                                                       chain as written and checks the stated figures
    <!-- ci: skip <kind>: <why> -->                    does not run in CI; <kind> is one of SKIP_KINDS
    <!-- ci: skip tested: tests/X.py ... -->            runs in tests/X.py, which reads its commands from the block
                                                       (`commands_tested_in`): for checks a plain run cannot make

A block without a marker fails the test, so a new command cannot land unrun by accident. The run blocks of one file
run in order in one scratch folder (a recipe's steps share `data/` and `outputs/`), which holds the checkout's files
as links and `run_train.sh` as a copy, so that nothing is written into the checkout.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field

SHELL = ("bash", "sh", "shell")
SKIP_KINDS = {
    "cluster": "needs several machines or a scheduler (SLURM)",
    "gpu": "needs a CUDA GPU",
    "user-files": "reads the user's own models, data or paths, which CI does not have",
    "download": "downloads from a hub CI cannot reach",
    "output": "shows what a command prints, not commands",
    "suite": "is the test suite itself (.ci/run runs it)",
    "benchmark": "is a measurement of minutes; its figures state their machine, command and date",
    "network": "needs network access CI does not have",
    "same": "runs as a `run` block of the named file (every one of its commands is one of that file's)",
    "tested": "runs in the named test module, which reads the block's commands from here (`commands_tested_in`)",
}
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*ci:\s*(.*?)\s*-->\s*$")
SETUP = 'python -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[dev]" && '
"""The set-up a `run; after set-up` block starts with: exactly the start of .ci/run's command line."""


@dataclass
class Block:
    path: str
    line: int
    """1-based line of the opening fence."""
    text: str
    mark: str | None
    run: bool = False
    append: list[str] = field(default_factory=list)
    after_setup: bool = False
    fresh: bool = False
    """Runs in a scratch folder of its own, not after the file's earlier blocks (`run; fresh`)."""
    skip_kind: str = ""
    check: str = ""
    same_as: str = ""

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse_mark(block: Block) -> str | None:
    """Fill in the block's run/skip settings from its marker; return a problem, or None."""
    if block.mark is None:
        return (f"{block.where}: a shell block without a CI marker; put <!-- ci: run --> (or <!-- ci: skip KIND: why -->, "
                f"KIND one of {', '.join(SKIP_KINDS)}) on the line before it")
    parts = [p.strip() for p in block.mark.split(";")]
    head = parts[0]
    if head.startswith("skip"):
        kind, _, why = head[len("skip"):].strip().partition(":")
        if kind.strip() not in SKIP_KINDS or not why.strip():
            return f"{block.where}: skip marker {block.mark!r}: write 'skip KIND: why', KIND one of {', '.join(SKIP_KINDS)}"
        block.skip_kind = kind.strip()
        if block.skip_kind in ("same", "tested"):
            block.same_as = why.strip().split()[0]
        return None
    if head != "run":
        return f"{block.where}: unknown CI marker {block.mark!r}"
    block.run = True
    for part in parts[1:]:
        if part.startswith("append "):
            block.append = part[len("append "):].split()
            if not all(a.startswith("--training.") or a.startswith("--model.") or not a.startswith("--")
                       for a in block.append):
                return f"{block.where}: only [training] and [model] sizes and steps may be appended, got {part!r}"
        elif part.startswith("check "):
            block.check = part[len("check "):].strip()
        elif part == "fresh":
            block.fresh = True
        elif part == "after set-up":
            block.after_setup = True
            code = [line for line in block.text.split("\n") if line.strip() and not line.lstrip().startswith("#")]
            if not code or not code[0].startswith(SETUP):
                return f"{block.where}: 'after set-up', but the block does not start with {SETUP!r}"
        else:
            return f"{block.where}: unknown CI marker part {part!r}"
    return None


def blocks(path: str, root: str) -> list[Block]:
    """The shell blocks of the Markdown file `path` (relative to `root`), with their markers (unparsed)."""
    lines = open(os.path.join(root, path)).read().split("\n")
    out, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if fence.group(1) in SHELL:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = MARK.match(before)
            out.append(Block(path, i + 1, "\n".join(lines[i + 1:end]) + "\n", mark.group(1) if mark else None))
        i = end + 1
    return out


def command_set(text: str) -> set[str]:
    """The commands of a shell text, one per entry: continuation lines joined, comments dropped, `&&` chains split,
    spaces collapsed (so a recipe written on one line or on several is the same set of commands)."""
    out = set()
    for line in text.replace("\\\n", " ").split("\n"):
        for command in _split_comment(line)[0].split("&&"):
            if command.strip():
                out.add(" ".join(command.split()))
    return out


def commands(block: Block, as_written: bool = False) -> str:
    """The block's shell text as CI runs it: the set-up prefix dropped (`after set-up`), the appended keys added to
    every `./run_train.sh`, `torchtrain.train` and `torchtrain.tools.parity` command (before a trailing comment, `&&`,
    `;`, `&` or `|`); `as_written`: nothing appended (the nightly run of a checked chain)."""
    text = re.sub(r"\s*\\\n\s*", " ", block.text)  # one line per command
    if block.after_setup:
        text = text.replace(SETUP, "", 1)
    if not block.append or as_written:
        return text
    extra = " " + " ".join(block.append)
    out = []
    for line in text.split("\n"):
        code, hash_, comment = _split_comment(line)
        pieces = re.split(r"(&&|\|\||;|&|\|)", code)
        pieces = [p.rstrip() + extra + " " if re.search(r"(\./run_train\.sh|-m torchtrain\.(train|tools\.parity))\b", p)
                  else p
                  for p in pieces]
        out.append("".join(pieces).rstrip() + (("  " + hash_ + comment) if hash_ else ""))
    return "\n".join(out)


def _split_comment(line: str) -> tuple[str, str, str]:
    """(code, "#" or "", comment) of a shell line: a `#` outside quotes that starts a word begins the comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], "#", line[i + 1:]
    return line, "", ""


def scratch_checkout(repo: str, folder: str) -> str:
    """A folder that looks like a fresh clone to the commands (the checkout's entries linked, run_train.sh
    copied so that it `cd`s there), and nothing a run writes reaches the checkout."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(repo):
        if name in (".git", ".venv", "outputs", "data") or name.startswith(".pytest"):
            continue
        target = os.path.join(folder, name)
        if name == "run_train.sh":
            shutil.copy2(os.path.join(repo, name), target)
        elif not os.path.lexists(target):
            os.symlink(os.path.join(repo, name), target)
    return folder


def documents(root: str) -> list[str]:
    """README.md and docs/*.md, relative to `root`: the files whose blocks are marked."""
    return ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(root, "docs"))
                                  if n.endswith(".md"))


def commands_tested_in(root: str, test_file: str) -> list[tuple[str, list[str]]]:
    """(where, argv) of every command in the documents' blocks marked `skip tested: <test_file>`: what that test runs
    (argv split as the shell would, without the leading `python`, comments dropped)."""
    import shlex

    out = []
    for path in documents(root):
        for block in blocks(path, root):
            if block.mark is None or parse_mark(block) or block.skip_kind != "tested" or block.same_as != test_file:
                continue
            for line in re.sub(r"\s*\\\n\s*", " ", block.text).split("\n"):
                code = _split_comment(line)[0].strip()
                if code:
                    argv = shlex.split(code)
                    out.append((block.where, argv[1:] if argv[0] in ("python", "python3") else argv))
    return out


def chains(found: list[Block]) -> list[list[Block]]:
    """The `run` blocks of one file in the chains CI runs one after another in one scratch folder: a `fresh` block
    starts a new chain."""
    out: list[list[Block]] = []
    for block in (b for b in found if b.run):
        if block.fresh or not out:
            out.append([])
        out[-1].append(block)
    return out
