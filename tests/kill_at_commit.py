"""Run a train.py (under torchrun) with rank 0 killed, SIGKILL, at the moment it would commit checkpoint STEP, in
torchrun's attempt ATTEMPT (0 = the first launch of the workers, 1 = after the first restart, ...) only: what a
node failing in the middle of writing a checkpoint leaves behind (every file of the checkpoint written, except the
one that marks it complete).

    torchrun --max-restarts=K ... tests/kill_at_commit.py STEP ATTEMPT experiments/<experiment>/train.py <its flags>
"""

import os
import runpy
import signal
import sys

from ftkit import checkpoint, ranks

step, attempt, script = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
commit = checkpoint.commit


def dying_commit(tmp, at_step, state, keep):
    if at_step == step and ranks.restart_count() == attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    return commit(tmp, at_step, state, keep)


checkpoint.commit = dying_commit
sys.argv = [script, *sys.argv[4:]]
runpy.run_path(script, run_name="__main__")
