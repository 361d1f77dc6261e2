#!/usr/bin/env python3
"""How much of its memory a process touches in a few seconds (docs/replay.md,
"How harsh the stand-ins are"): the data trajectory's stand-in, and a real
Jupyter kernel (ipykernel) holding the same 64 MiB frame, idle and running
cells. Touched = the pages whose accessed bit the kernel set after
/proc/PID/clear_refs cleared them (smaps "Referenced"), counted over the
process's anonymous mappings (its heap: what offload pushes out).

Needs root (clear_refs of another process), this tree's replay trajectories
and the code interpreter template's packages (ipykernel, jupyter_client),
which scripts/test.sh builds into build/debug/tests-rootfs:

  T=build/debug/tests-rootfs
  PYTHONPATH=$T/code-interpreter-v1/packages/usr/lib/python3/dist-packages:$T/base/usr/lib/python3/dist-packages \\
  LD_LIBRARY_PATH=$T/code-interpreter-v1/packages/usr/lib/x86_64-linux-gnu \\
    python3 tests/bench/replay/kernel_touch.py
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SECONDS = 5
FRAME = ("import random\nrng = random.Random(1)\n"
         "items = [[rng.uniform(0, 100) for _ in range(6)] + ['cat%d' % rng.randrange(50)] for _ in range(64 * 2500)]\n")


def anon_kib(pid):
    """(resident, referenced) KiB over pid's anonymous mappings."""
    rss = ref = 0
    anon = False
    with open('/proc/%d/smaps' % pid) as f:
        for line in f:
            m = re.match(r'^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ (\d+)\s*(.*)$', line)
            if m:
                anon = m.group(1) == '0' and m.group(2) in ('', '[heap]')
            elif anon and line.startswith('Rss:'):
                rss += int(line.split()[1])
            elif anon and line.startswith('Referenced:'):
                ref += int(line.split()[1])
    return rss, ref


def touched(pid, action):
    with open('/proc/%d/clear_refs' % pid, 'w') as f:
        f.write('1')
    action()
    return anon_kib(pid)


def row(what, kib):
    rss, ref = kib
    print('| %s | %.1f MiB | %.1f MiB | %.1f %% |' % (what, rss / 1024, ref / 1024, 100 * ref / max(rss, 1)), flush=True)


def standin():
    traj = json.load(open(os.path.join(HERE, 'trajectories', 'data.json')))
    script = traj['setup'][1].split("<<'PYEOF'\n", 1)[1].rsplit('PYEOF', 1)[0]
    d = tempfile.mkdtemp()
    path = os.path.join(d, 'standin.py')
    with open(path, 'w') as f:
        f.write(script.replace('/tmp/standin.ready', os.path.join(d, 'ready')))
    p = subprocess.Popen([sys.executable, path, 'frame', '64', '1'])
    try:
        while not os.path.exists(os.path.join(d, 'ready')):
            time.sleep(0.1)
        row('the data stand-in, running %d s' % SECONDS, touched(p.pid, lambda: time.sleep(SECONDS)))
    finally:
        p.kill()
        p.wait()


def kernel():
    from jupyter_client.manager import KernelManager
    km = KernelManager(kernel_name='python3')
    km.kernel_cmd = [sys.executable, '-m', 'ipykernel_launcher', '-f', '{connection_file}']
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)

        def run(code):
            kc.execute_interactive(code, timeout=120, output_hook=lambda m: None)
        run(FRAME)
        pid = km.provisioner.process.pid
        row('ipykernel holding the frame, idle %d s' % SECONDS, touched(pid, lambda: time.sleep(SECONDS)))
        row('the same, idle %d s again' % SECONDS, touched(pid, lambda: time.sleep(SECONDS)))
        row('a cell over 1000 rows', touched(pid, lambda: run('s = sum(r[0] for r in items[:1000])')))
        row('a cell over every row (a column mean)', touched(pid, lambda: run('m = sum(r[0] for r in items) / len(items)')))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


if __name__ == '__main__':
    print('| process | anonymous resident | touched | share |')
    print('| --- | --- | --- | --- |')
    standin()
    kernel()
