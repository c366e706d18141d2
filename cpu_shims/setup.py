"""Ships ``flowrl_cpu_shims.pth`` next to the module, so every interpreter of the venv installs the hook."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file("flowrl_cpu_shims.pth", os.path.join(self.build_lib, "flowrl_cpu_shims.pth"))


setup(cmdclass={"build_py": BuildWithPth})
