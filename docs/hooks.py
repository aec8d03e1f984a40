"""MkDocs hook: the pages that are generated from the code are generated at build time, so they
cannot drift from it.

- rules.md: `<!-- rules -->` becomes the table of every registered rule (the `auditor.rules` entry
  points) and, per rule, the text `audit explain ID` prints (`Rule.explanation`, one source).
- schemas.md: `<!-- schema: NAME -->` becomes the JSON schema msgspec derives from the Struct NAME
  (`Finding`: one entry of findings.json's `findings`; `Evidence`: evidence.json), one table per Struct.
- speed.md: `<!-- speed-table -->` becomes the README's speed table (the README holds it; the page
  adds what the README has no room for).
- any page: `<!-- flags: COMMAND -->` becomes the table of that `audit` command's options, from the
  click command itself (its flags, defaults and help: what `audit COMMAND --help` prints).
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import msgspec

SCHEMA_ROOTS = {"Finding": "auditor.findings:Finding", "Evidence": "auditor.evidence.model:Evidence"}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    name = page.file.src_uri
    if name == "rules.md":
        return markdown.replace("<!-- rules -->", rules_reference())
    if name == "schemas.md":
        return re.sub(r"<!-- schema: (\w+) -->", lambda m: schema_reference(m.group(1)), markdown)
    if name == "speed.md":
        readme = Path(config["docs_dir"]).parent / "README.md"
        markdown = markdown.replace("<!-- speed-table -->", speed_table(readme.read_text()))
    return re.sub(r"<!-- flags: (\w+) -->", lambda m: flags_table(m.group(1)), markdown)


DEFAULT = re.compile(r"\s*\[default: ([^\]]*)\]\.?")


def flags_table(command: str) -> str:
    """| flag | default | meaning | of every option of `audit COMMAND` but --help, in its --help order."""
    import click

    from auditor.cli import cli

    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    cmd = cli.commands[command]
    ctx = click.Context(cmd, info_name=command)
    for p in cmd.params:
        if not isinstance(p, click.Option) or p.hidden or p.name == "help":
            continue
        names = [*p.opts, *p.secondary_opts]
        if p.metavar or not isinstance(p.type, (click.IntRange, click.FloatRange)):
            metavar = p.make_metavar(ctx) if "ctx" in inspect.signature(p.make_metavar).parameters else p.make_metavar()
        else:
            metavar = "N" if isinstance(p.type, click.IntRange) else "X"
        flag = " / ".join(f"`{o}`" for o in names) if p.is_flag else ", ".join(f"`{o} {metavar}`" for o in names)
        text = p.help or ""
        said = DEFAULT.search(text)
        value = p.get_default(ctx, call=False)
        if said:
            default, text = said.group(1), DEFAULT.sub("", text)
        elif p.is_flag and p.secondary_opts:  # --x/--no-x: the one in force, or none chosen
            default = "auto" if value is None else f"`{p.opts[0] if value else p.secondary_opts[0]}`"
        elif p.is_flag:
            default = "on" if value else "off"
        else:
            # (click's marker for "no default" reads as none, as an empty tuple does)
            default = "none" if value in (None, (), []) or "UNSET" in repr(value) else str(value)
        rows.append(f"| {_cell(flag)} | {_cell(default)} | {_cell(text.strip())} |")
    return "\n".join(rows)


def rules_reference() -> str:
    from auditor.rules.registry import all_rules

    rules = all_rules()
    out = ["| id | severity | category | evidence | title |", "| --- | --- | --- | --- | --- |"]
    for rule_id, cls in rules.items():
        needs = ", ".join(sorted(cls.needs)) or "any"
        out.append(f"| [`{rule_id}`](#{rule_id}) | {cls.severity} | {cls.category} | {needs} | {_cell(cls.title)} |")
    out.append("")
    for rule_id, cls in rules.items():
        out += [f"## {rule_id} {{ #{rule_id} }}", "", f"`audit explain {rule_id}`:", "", "```text",
                cls.explanation().rstrip("\n"), "```", ""]
    return "\n".join(out)


def schema_reference(root: str) -> str:
    module, _, attr = SCHEMA_ROOTS[root].partition(":")
    struct = getattr(__import__(module, fromlist=[attr]), attr)
    (top,), components = msgspec.json.schema_components([struct], ref_template="#{name}")
    out = []
    for name in _reachable(top["$ref"].lstrip("#"), components):
        out += _struct_table(name, components[name])
    return "\n".join(out)


def _reachable(start: str, components: dict[str, Any]) -> list[str]:
    """The Structs a root refers to, the root first, each once, in the order they are met."""
    seen: list[str] = []
    stack = [start]
    while stack:
        name = stack.pop(0)
        if name in seen:
            continue
        seen.append(name)
        stack += re.findall(r'"\$ref":"#(\w+)"', msgspec.json.encode(components[name]).decode())
    return seen


def _struct_table(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name} {{ #{name.lower()} }}", ""]
    doc = schema.get("description") or ""
    if doc:
        out += [" ".join(doc.split()), ""]
    props = schema.get("properties")
    if props is None:  # an enum or a literal
        out += [f"One of: {_type(schema)}", ""]
        return out
    required = set(schema.get("required", ()))
    out += ["| field | type | required |", "| --- | --- | --- |"]
    for field, spec in props.items():
        out.append(f"| `{field}` | {_type(spec)} | {'yes' if field in required else ''} |")
    out.append("")
    return out


def _type(spec: dict[str, Any]) -> str:
    if "$ref" in spec:
        target = spec["$ref"].lstrip("#")
        return f"[{target}](#{target.lower()})"
    if "anyOf" in spec:
        return " or ".join(_type(s) for s in spec["anyOf"])
    if "enum" in spec:
        return " \\| ".join(f"`{v!r}`" for v in spec["enum"])
    if "const" in spec:
        return f"`{spec['const']!r}`"
    kind = spec.get("type")
    if kind == "array":
        items = spec.get("items") or (spec.get("prefixItems") and {"anyOf": spec["prefixItems"]})
        return f"array of {_type(items) if items else 'any'}"
    if kind == "object":
        values = spec.get("additionalProperties")
        return f"object of {_type(values)}" if isinstance(values, dict) and values else "object"
    if isinstance(kind, list):
        return " or ".join(kind)
    return kind or "any"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def speed_table(readme: str) -> str:
    """The README's table under `## Speed`: its lines from the header row to the first blank line."""
    section = readme.split("\n## Speed", 1)[1]
    lines = section.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("| what |"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return "\n".join(lines[start:end])
