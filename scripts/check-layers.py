#!/usr/bin/env python3
"""The layer check: fails on an #include that runs up a layer.

sandgate's code is a stack of units (docs/design.md, "Layers"). Each unit is
a folder (or one header) named by its path from the repository root, which
is the one include root: every quoted include names its folder
("base/status.h", "wait-engine/memory/pool.h"). A unit may include itself
and the units below it (the transitive closure of LAYERS); anything else is
an upward (or sideways) include and fails the check.

Also checked: every quoted include resolves from the repository root (no
include relative to a file's own folder or to another include path), and
every source file belongs to a unit (a new folder needs a line here).

Usage: check-layers.py [ROOT]   (ROOT defaults to this script's repository)
Exit 0 when clean, 1 with one line per finding.
"""
import os
import re
import sys

# unit -> the units it stands on directly. Lowest first.
LAYERS = {
    'base': [],
    'base/http': ['base'],
    'storage': ['base'],
    'tenancy': ['storage'],
    'sandbox-runtime/runtime.h': ['base'],
    'sandbox-runtime/channel': ['base'],
    'sandbox-runtime/templates': ['base'],
    'sandbox-runtime/vmm': ['base'],
    # The rtnetlink client: the host's networks and a microVM's agent (its eth0).
    'sandbox-runtime/network/rtnl.h': ['base'],
    'sandbox-runtime/network': ['base', 'sandbox-runtime/network/rtnl.h'],
    'sandbox-runtime/lifecycle': ['base/http', 'tenancy', 'sandbox-runtime/runtime.h', 'sandbox-runtime/channel',
                                  'sandbox-runtime/network', 'sandbox-runtime/host', 'wait-engine/coordinator'],
    'sandbox-runtime/agent': ['sandbox-runtime/channel', 'sandbox-runtime/network/rtnl.h'],
    'sandbox-runtime/host': ['sandbox-runtime/channel', 'sandbox-runtime/runtime.h'],
    'sandbox-runtime/process': ['sandbox-runtime/host', 'sandbox-runtime/templates'],
    # The runtime that starts sandgate-vmm speaks its attach protocol (vm/attach_protocol.h).
    'sandbox-runtime/microvm': ['sandbox-runtime/host', 'sandbox-runtime/vmm'],
    'wait-engine/metrics': ['base'],
    'wait-engine/coordinator': ['wait-engine/metrics'],
    'wait-engine/memory': ['wait-engine/metrics', 'storage', 'sandbox-runtime/lifecycle'],
    'wait-engine/llm': ['wait-engine/coordinator', 'wait-engine/memory', 'base/http', 'sandbox-runtime/lifecycle'],
    'sandbox-runtime/builds': ['base/http', 'tenancy', 'sandbox-runtime/host', 'sandbox-runtime/templates',
                               'sandbox-runtime/network'],
    'api-e2b': ['sandbox-runtime/lifecycle', 'sandbox-runtime/builds'],
    'gateway': ['api-e2b', 'sandbox-runtime/process', 'sandbox-runtime/microvm', 'sandbox-runtime/templates',
                'wait-engine/llm'],
    # The tests may include anything, from the root like everyone else.
    'tests': ['gateway', 'sandbox-runtime/agent', 'sandbox-runtime/vmm'],
}

SOURCE = re.compile(r'\.(h|hpp|cpp|cc)$')
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SKIP_DIRS = {'build', 'node_modules', '.git', '.venv', 'venv'}


def unit_of(path):
    """The longest unit that is path or a folder above it."""
    best = None
    for u in LAYERS:
        if path == u or path.startswith(u + '/'):
            if best is None or len(u) > len(best):
                best = u
    return best


def closure():
    below = {}

    def walk(u, seen):
        for d in LAYERS[u]:
            if d not in seen:
                seen.add(d)
                walk(d, seen)
        return seen

    for u in LAYERS:
        below[u] = walk(u, set())
    return below


def sources(root):
    for d, dirs, files in os.walk(root):
        # Build trees sit at the top (build/, build-*/); sandbox-runtime/builds is source.
        top = os.path.samefile(d, root)
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith('.') and
                         not (top and x.startswith('build')))
        for f in sorted(files):
            if SOURCE.search(f):
                yield os.path.relpath(os.path.join(d, f), root)


def check(root):
    below = closure()
    findings = []
    for rel in sources(root):
        src_unit = unit_of(rel)
        if src_unit is None:
            findings.append(f'{rel}: in no unit of scripts/check-layers.py LAYERS')
            continue
        with open(os.path.join(root, rel), encoding='utf-8', errors='replace') as fh:
            text = fh.read()
        for m in INCLUDE.finditer(text):
            inc = m.group(1)
            line = text.count('\n', 0, m.start()) + 1
            if not os.path.isfile(os.path.join(root, inc)):
                findings.append(f'{rel}:{line}: "{inc}" does not name a file from the repository root')
                continue
            dst_unit = unit_of(inc)
            if dst_unit is None:
                findings.append(f'{rel}:{line}: "{inc}" is in no unit')
            elif dst_unit != src_unit and dst_unit not in below[src_unit]:
                findings.append(f'{rel}:{line}: "{inc}" runs up a layer ({src_unit} may not include {dst_unit})')
    return findings


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    findings = check(root)
    for f in findings:
        print(f)
    if findings:
        print(f'check-layers: {len(findings)} finding(s)', file=sys.stderr)
        return 1
    print('check-layers: every include names its folder and runs down the layers')
    return 0


if __name__ == '__main__':
    sys.exit(main())
