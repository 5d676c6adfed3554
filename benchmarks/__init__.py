"""Benchmarks of kvcomm-agents. A run does not depend on what ran on the machine before it: no
engine built here remembers measurements from earlier engines unless a run asks for it
(``python -m benchmarks --remembered FOLDER``, strategy ``kvcomm-remembered``)."""

import os

os.environ.setdefault("KVCOMM_REMEMBER_MEASUREMENTS", "0")
