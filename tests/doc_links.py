#!/usr/bin/env python3
"""Every link in the project's Markdown that points into the tree resolves: the file or folder
exists and, with a #fragment, the target page has a heading of that anchor (GitHub's rule:
lower case, punctuation dropped, spaces to hyphens, -1, -2 ... for repeats). Web links are not
fetched. Run by tests/doc_links_test.cpp; by hand:

    python3 tests/doc_links.py [SOURCE_ROOT]     # prints each broken link, exits 1 if any
"""
import os
import re
import subprocess
import sys

INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*<?(\S+?)>?(?:\s+.*)?$")
REF_USE = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])+)\]\[([^\]]*)\]")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(text):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(path):
    """(line number, text, raw text) of the lines outside fenced code; text has its inline code
    spans blanked (a link inside one is not a link), raw keeps them (they count in anchors)."""
    fence = None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            stripped = line.lstrip()
            m = re.match(r"(`{3,}|~{3,})", stripped)
            if m:
                if fence is None:
                    fence = m.group(1)[0] * len(m.group(1))
                elif stripped.startswith(fence):
                    fence = None
                continue
            if fence is None and not line.startswith("    "):
                raw = line.rstrip("\n")
                yield n, re.sub(r"`+[^`]*`+", "", raw), raw


_anchors = {}


def anchors(path):
    if path not in _anchors:
        seen, found = {}, set()
        for _, _, raw in prose_lines(path):
            m = HEADING.match(raw)
            if not m:
                continue
            base = slug(m.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        _anchors[path] = found
    return _anchors[path]


def markdown_files(root):
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.md"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # an exported tree: no git
        out = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
               for f in fs if f.endswith(".md")]
    skip = ("build", ".deps", "data/", "runs/", "shared/")
    return sorted(p for p in out if not p.startswith(skip) and os.path.isfile(os.path.join(root, p)))


def check(root):
    broken = []
    for rel in markdown_files(root):
        path = os.path.join(root, rel)
        lines = list(prose_lines(path))
        defs = {}
        for n, line, _ in lines:
            m = REF_DEF.match(line)
            if m:
                defs[m.group(1).lower()] = (n, m.group(2))
        targets = [(n, t) for n, t in defs.values()]
        for n, line, _ in lines:
            if REF_DEF.match(line):
                continue
            targets += [(n, m.group(1)) for m in INLINE.finditer(line)]
            for m in REF_USE.finditer(line):
                ref = (m.group(2) or m.group(1)).lower()
                if ref not in defs:
                    broken.append(f"{rel}:{n}: [{m.group(1)}][{m.group(2)}]: no such reference")
        for n, target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part \
                else path
            if not os.path.exists(dest):
                broken.append(f"{rel}:{n}: {target}: no such file")
            elif fragment and dest.endswith(".md") and fragment.lower() not in anchors(dest):
                broken.append(f"{rel}:{n}: {target}: no heading with that anchor")
    return broken


if __name__ == "__main__":
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    broken = check(root)
    for b in broken:
        print(b)
    print(f"doc_links: {len(broken)} broken link(s) in {len(markdown_files(root))} Markdown files")
    sys.exit(1 if broken else 0)
