#!/usr/bin/env python3
"""scripts/check-layers.py must pass on the tree and fail on each kind of
bad include. Runs the check on copies of the tree's sources, each with one
bad include added, and expects that include (and only it) to be reported."""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(ROOT, 'scripts', 'check-layers.py')
failures = []


def run(root):
    p = subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True)
    return p.returncode, p.stdout


def copy_tree(dst):
    for d, dirs, files in os.walk(ROOT):
        # Build trees sit at the top (build/, build-*/); sandbox-runtime/builds is source.
        top = os.path.samefile(d, ROOT)
        dirs[:] = [x for x in dirs if x not in ('node_modules', '.git') and not x.startswith('.') and
                   not (top and x.startswith('build'))]
        for f in files:
            if f.endswith(('.h', '.hpp', '.cpp', '.cc')):
                rel = os.path.relpath(os.path.join(d, f), ROOT)
                os.makedirs(os.path.join(dst, os.path.dirname(rel)), exist_ok=True)
                shutil.copy(os.path.join(ROOT, rel), os.path.join(dst, rel))


def expect(name, cond, detail=''):
    print(('ok   ' if cond else 'FAIL ') + name + ('' if cond else ': ' + detail))
    if not cond:
        failures.append(name)


rc, out = run(ROOT)
expect('the tree passes', rc == 0, out)

CASES = [
    # (file to append to, include line, what the finding must say)
    ('base/status.h', '#include "gateway/app.h"', 'runs up a layer (base may not include gateway)'),
    ('storage/store.h', '#include "api-e2b/control_plane.h"', 'runs up a layer (storage may not include api-e2b)'),
    ('sandbox-runtime/lifecycle/sandbox_service.cpp', '#include "wait-engine/memory/offload.h"',
     'sandbox-runtime/lifecycle may not include wait-engine/memory'),
    ('sandbox-runtime/microvm/microvm_runtime.cpp', '#include "sandbox-runtime/process/userns.h"',
     'sandbox-runtime/microvm may not include sandbox-runtime/process'),
    ('wait-engine/memory/pool.cpp', '#include "wait-engine/llm/proxy.h"',
     'wait-engine/memory may not include wait-engine/llm'),
    ('api-e2b/control_plane.cpp', '#include "status.h"', 'does not name a file from the repository root'),
]
for path, line, want in CASES:
    with tempfile.TemporaryDirectory() as tmp:
        copy_tree(tmp)
        with open(os.path.join(tmp, path), 'a') as fh:
            fh.write('\n' + line + '\n')
        rc, out = run(tmp)
        lines = [l for l in out.splitlines() if l]
        expect(f'{path} + {line}', rc == 1 and len(lines) == 1 and path in lines[0] and want in lines[0], out)

with tempfile.TemporaryDirectory() as tmp:
    copy_tree(tmp)
    os.makedirs(os.path.join(tmp, 'newfolder'))
    with open(os.path.join(tmp, 'newfolder', 'x.cpp'), 'w') as fh:
        fh.write('#include "base/status.h"\n')
    rc, out = run(tmp)
    expect('a file in no unit', rc == 1 and 'newfolder/x.cpp: in no unit' in out, out)

sys.exit(1 if failures else 0)
