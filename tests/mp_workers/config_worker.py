"""Worker for tests/test_launch.py: one process of a `jax_ep.launch` job comparing configurations.

Usage: `python -m jax_ep.launch -n 2 -- python tests/mp_workers/config_worker.py MODE`, MODE one of
  match     every process passes the same fields                   -> exit 0
  mismatch  `hidden` differs between process 0 and the others      -> exit 17 (ValueError)
  timeout   process 1 never publishes; process 0 waits for 3 s     -> exit 18 on process 0
            (TimeoutError), 0 on the others
  gather    every process publishes a value and reads every other's (prints them) -> exit 0
The exception message is printed as `ValueError: ...` / `TimeoutError: ...` for the test to read.
"""

import os
import pathlib
import sys
import time

# Run from a checkout without installing it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from jax_ep.launch import _distributed  # noqa: E402
from jax_ep.launch import initialize_from_env  # noqa: E402

EXIT_VALUE_ERROR = 17
EXIT_TIMEOUT_ERROR = 18


def main(mode: str) -> int:
  assert initialize_from_env(), "start this worker with python -m jax_ep.launch"
  assert initialize_from_env(), "a second call must be a no-op that still reports True"
  pid = int(os.environ["JAX_EP_PROCESS_ID"])
  if mode == "timeout" and pid == 1:
    # Never publishes; stays alive past process 0's timeout.
    time.sleep(4.0)
    return 0
  if mode == "gather":
    values = _distributed.gather_values("gather-test", f"value-{pid}", process_ids=[0, 1],
                                        timeout_s=30.0)
    print("gathered", " ".join(values), flush=True)
    return 0
  hidden = 128 if (mode == "match" or pid == 0) else 256
  try:
    _distributed.check_same_config(_distributed.next_group_key("t"),
                                   {"hidden": hidden, "num_experts": 8},
                                   timeout_s=3.0 if mode == "timeout" else 30.0)
  except ValueError as e:
    print(f"ValueError: {e}", flush=True)
    return EXIT_VALUE_ERROR
  except TimeoutError as e:
    print(f"TimeoutError: {e}", flush=True)
    return EXIT_TIMEOUT_ERROR
  print("config ok", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
