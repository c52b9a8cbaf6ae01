"""The harness around the runtime: running gloo ranks (`launch`, and `worker`: what runs in each),
the tiny training runs and their single-process twins that the verification ladder compares
(`training`, `verify`), measuring a machine into a hardware profile (`calibrate`) and the simulator
against the runtime (`validate`).

It uses `canzona.runtime` and `reference/`; nothing in `canzona.runtime` imports it. Importing this
package imports nothing: `verify`'s limits and the CLI load without torch.
"""
