"""The report's two renderers: a list of blocks (:mod:`src.reports.sections`) as GitHub-flavoured
Markdown, or as one self-contained HTML page (plots inlined as base64 PNG)."""

from __future__ import annotations

import base64
import html
import re
from typing import Any, Mapping, Sequence

Block = tuple  # ("h1"|"h2"|"h3"|"p"|"ul"|"table"|"image", ...)
"""One piece of the page: a heading, paragraph, list, table or image, as :mod:`src.reports.sections` makes them."""


def _md_cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: Sequence[Block]) -> str:
    """Render blocks as GitHub-flavoured Markdown (images link to the PNG files)."""
    out: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + block[1])
        elif kind == "p":
            out.append(block[1])
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in block[1]))
        elif kind == "table":
            headers, rows = block[1], block[2]
            lines = ["| " + " | ".join(map(_md_cell, headers)) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines))
        elif kind == "image":
            out.append(f"![{block[3]}]({block[1]})")
    return "\n\n".join(out) + "\n"


def _inline_html(text: str) -> str:
    escaped = html.escape(str(text))
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    escaped = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", r'<a href="\2">\1</a>', escaped)  # [text](relative link)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}
th{background:#f2f2f2}img{max-width:100%;border:1px solid #eee}code{background:#f6f6f6;padding:0 3px}"""


def to_html(blocks: Sequence[Block], images: Mapping[str, bytes]) -> str:
    """Render blocks as one self-contained HTML page; ``images`` maps a plot name to its PNG bytes."""
    body: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{_inline_html(block[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{_inline_html(block[1])}</p>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{_inline_html(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{_inline_html(h)}</th>" for h in block[1])
            rows = "".join("<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in row) + "</tr>" for row in block[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "image":
            data = base64.b64encode(images[block[2]]).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(block[3])}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline_html(block[3])}</figcaption></figure>"
            )
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Performance report</title>"
        f"<style>{_STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
