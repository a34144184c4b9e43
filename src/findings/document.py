"""The generated blocks of docs/findings.md: which differ from what the records give, and rewriting them.

A block lies between ``<!-- findings:NAME -->`` and ``<!-- /findings:NAME -->``; its content is
:func:`src.findings.render.render`'s. Text only: the caller reads and writes the file.
"""

from __future__ import annotations


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- findings:{name} -->", f"<!-- /findings:{name} -->"


def check_document(text: str, blocks: dict[str, str]) -> list[str]:
    """One line per block of ``text`` that is missing or differs from ``blocks`` (empty: all agree)."""
    problems = []
    for name, expected in blocks.items():
        begin, end = _markers(name)
        if begin not in text or end not in text:
            problems.append(f"block {name}: missing (markers {begin} ... {end})")
            continue
        found = text.split(begin, 1)[1].split(end, 1)[0].strip("\n")
        if found != expected.strip("\n"):
            problems.append(f"block {name}: differs from what the committed results give")
    return problems


def update_document(text: str, blocks: dict[str, str]) -> str:
    """``text`` with every block's content replaced (each block's markers must be there)."""
    for name, content in blocks.items():
        begin, end = _markers(name)
        if begin not in text or end not in text:
            raise ValueError(f"block {name}: markers {begin} ... {end} not in the document")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{content}\n{end}{tail}"
    return text
