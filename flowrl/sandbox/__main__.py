"""``python -m flowrl.sandbox``: print the isolation layers that hold here, then run one program."""

from __future__ import annotations

import sys

from flowrl.sandbox import SandboxPool


def main() -> int:
    with SandboxPool(1) as pool:
        width = max(len(layer.name) for layer in pool.layers)
        for layer in pool.layers:
            print(f"{layer.name:<{width}}  {'active  ' if layer.active else 'INACTIVE'}  {layer.detail}")
        res = pool.run("print('hello from the sandbox')")
    print(f"trial run: exit {res.exit_code}, {res.wall_s * 1000:.0f} ms, stdout {res.stdout!r}")
    return 0 if res.ok and all(layer.active for layer in pool.layers) else 1


if __name__ == "__main__":
    sys.exit(main())
