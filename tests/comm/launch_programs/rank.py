"""One rank of a test job under ``ninefold.comm.launch``; what it does is the first argument.

``env ARGS...``: print one JSON line with the rendezvous environment, the pid and ARGS.
``talk``: print long lines on stdout, one on stderr, and a last stdout line without a newline.
``wait DIR [--child] [--stubborn] [--fail RANK:CODE|RANK:kill] [--leave]``: write DIR/RANK.json with
this pid (and, with --child, the pid of a child process it starts, which sleeps), then sleep; SIGINT
and SIGTERM print ``rank R got SIGNAME`` and exit 128 + the signal (--stubborn ignores SIGTERM).
With --fail, rank RANK waits until every other rank wrote its file, then exits with CODE or kills
itself with SIGKILL. With --leave, every rank exits 0 at once, leaving its child behind.
"""

import json
import os
import signal
import subprocess
import sys
import time

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "NINEFOLD_COMM_LAUNCHED", "CUDA_VISIBLE_DEVICES", "EXTRA")
LONG = "x" * 3000
RANK = int(os.environ["RANK"])


def report_env(args):
    print(json.dumps({"pid": os.getpid(), "args": args, **{name: os.environ.get(name) for name in NAMES}}))


def talk():
    for i in range(50):
        print(f"rank {RANK} line {i} {LONG}")
    print(f"rank {RANK} to stderr", file=sys.stderr)
    sys.stdout.write(f"rank {RANK} last line")


def on_signal(signum, frame):
    print(f"rank {RANK} got {signal.Signals(signum).name}", flush=True)
    sys.exit(128 + signum)


def wait(directory, flags):
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if "--stubborn" in flags else on_signal)
    record = {"pid": os.getpid()}
    if "--child" in flags:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        record["child"] = child.pid
    path = os.path.join(directory, f"{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(path + ".tmp", path)  # the test sees whole files only
    if "--leave" in flags:
        sys.exit(0)
    fail = flags[flags.index("--fail") + 1].split(":") if "--fail" in flags else None
    if fail and int(fail[0]) == RANK:
        world = int(os.environ["WORLD_SIZE"])
        deadline = time.monotonic() + 30
        while len([n for n in os.listdir(directory) if n.endswith(".json")]) < world and time.monotonic() < deadline:
            time.sleep(0.02)
        if fail[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(fail[1]))
    time.sleep(60)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "env":
        report_env(rest)
    elif mode == "talk":
        talk()
    else:
        wait(rest[0], rest[1:])
