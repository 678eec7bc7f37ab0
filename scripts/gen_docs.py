"""Write the generated tables of docs/configuration.md from the code, so that the reference cannot drift.

    python scripts/gen_docs.py            # rewrite the generated blocks in place
    python scripts/gen_docs.py --check    # exit 1 (and say which block) when the file differs from the code

Two blocks are generated, each between ``<!-- BEGIN GENERATED: NAME -->`` and ``<!-- END GENERATED: NAME -->``:

* ``config-keys``: every field of ``shardsafe.config.ShardsafeConfig`` (the DeepSpeed "shardsafe" block), its type,
  its default and its docstring (the string literal under the field in config.py);
* ``megatron-flags``: every option of ``shardsafe.adapters.megatron.args.add_arguments``, the key it sets and its
  help text (which says its default).

Everything else in the page is written by hand; tests/unit/test_docs.py runs :func:`render` and fails when the
file differs from what this script would write.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"

# Fields whose empty default is filled in from the environment when a job starts (ShardsafeConfig.resolved,
# shardsafe.env): what they resolve to, in words. A field with a computed default and no entry here is an error,
# not a silent gap in the table.
FACTORY_DEFAULTS = {
    "holder_dir": "`$SHARDSAFE_HOLDER_DIR`, else `$XDG_RUNTIME_DIR/shardsafe-UID`, else `/tmp/shardsafe-UID`",
    "node": "`$SHARDSAFE_NODE`, else `$SLURMD_NODENAME`, else the host name",
}

# Config keys whose Megatron flag is not "--shardsafe-" + the key (or which have none).
MEGATRON_SPECIAL = {
    "enabled": "--shardsafe",
    "restore": "--shardsafe-no-restore",
    "start_holder": "--shardsafe-no-start-holder",
    "resume_client_state": None,   # DeepSpeed programs' load_checkpoint; Megatron has no such path
}


def _field_docs() -> dict[str, str]:
    """Each field's docstring: the string literal right after its annotated assignment in config.py."""
    from shardsafe import config
    tree = ast.parse(inspect.getsource(config))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ShardsafeConfig")
    docs: dict[str, str] = {}
    body = cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and i + 1 < len(body):
            nxt = body[i + 1]
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = nxt.value.value
    return docs


def _md(text: str) -> str:
    """One table cell: whitespace collapsed, reST literals as Markdown code, pipes escaped."""
    text = " ".join(text.split())
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r":(?:func|class|data|meth|mod):`~?([^`]+)`", r"`\1`", text)
    return text.replace("|", "\\|")


def _choices() -> dict[str, tuple[str, ...]]:
    from shardsafe import config
    return {"parity_transport": config.PARITY_TRANSPORTS, "restore_h2d": config.RESTORE_H2D,
            "resume_client_state": config.RESUME_CLIENT_STATES, "resume": config.RESUME,
            "on_unprotected": config.ON_UNPROTECTED}


def config_table() -> str:
    from shardsafe.config import ShardsafeConfig
    docs = _field_docs()
    choices = _choices()
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(ShardsafeConfig):
        if f.name not in docs:
            raise SystemExit(f"gen_docs: ShardsafeConfig.{f.name} has no docstring (a string literal under the "
                             "field, as the others have): the reference would have nothing to say about it")
        typ = f.type if isinstance(f.type, str) else f.type.__name__
        if f.name in choices:
            typ = " \\| ".join(json.dumps(c) for c in choices[f.name])
        if f.name in FACTORY_DEFAULTS:
            default = FACTORY_DEFAULTS[f.name]
        elif f.default is not dataclasses.MISSING:
            default = f"`{json.dumps(f.default)}`"
        else:
            raise SystemExit(f"gen_docs: ShardsafeConfig.{f.name}'s default is computed: say what it resolves to in "
                             "FACTORY_DEFAULTS (scripts/gen_docs.py)")
        rows.append(f"| `{f.name}` | {typ} | {default} | {_md(docs[f.name])} |")
    return "\n".join(rows)


def megatron_actions() -> list[argparse.Action]:
    from shardsafe.adapters.megatron.args import GROUP_TITLE, add_arguments
    parser = add_arguments(argparse.ArgumentParser(add_help=False))
    group = next(g for g in parser._action_groups if g.title == GROUP_TITLE)
    return list(group._group_actions)


def megatron_key(action: argparse.Action) -> str:
    """The ShardsafeConfig key a Megatron flag sets."""
    flag = action.option_strings[0]
    for key, special in MEGATRON_SPECIAL.items():
        if special == flag:
            return key
    return flag[len("--shardsafe-"):].replace("-", "_")


def megatron_table() -> str:
    rows = ["| flag | key | meaning |", "|---|---|---|"]
    for a in megatron_actions():
        flag = a.option_strings[0]
        if a.nargs != 0:
            metavar = a.metavar or ("{" + ",".join(a.choices) + "}" if a.choices else a.dest.upper()
                                    .removeprefix("SHARDSAFE_"))
            flag = f"{flag} {metavar}"
        rows.append(f"| `{flag}` | `{megatron_key(a)}` | {_md(a.help or '')} |")
    return "\n".join(rows)


BLOCKS = {"config-keys": config_table, "megatron-flags": megatron_table}


def render(text: str) -> str:
    """``text`` (the page) with every generated block replaced by what the code says now."""
    for name, make in BLOCKS.items():
        begin, end = f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"
        if text.count(begin) != 1 or text.count(end) != 1:
            raise SystemExit(f"gen_docs: {PAGE.relative_to(ROOT)} must hold exactly one {begin} ... {end}")
        head, rest = text.split(begin)
        _, tail = rest.split(end)
        text = f"{head}{begin}\n{make()}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only say whether the page is current (exit 1 if not)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    old = PAGE.read_text()
    new = render(old)
    if a.check:
        if new != old:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/gen_docs.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        PAGE.write_text(new)
        print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
