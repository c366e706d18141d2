"""Suite-wide settings: estimates never depend on this machine's speed."""

import os

# `flowrl plan` measures the machine for gpu = "cpu" on first use (flowrl.cost.autoprofile); the suite's
# plans, goldens and documented commands use the fixed figures instead (tests of the automatic
# profile turn it back on for themselves)
os.environ["FLOWRL_AUTO_PROFILE"] = "0"
