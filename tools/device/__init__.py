"""The GPU machine: its drivers (shell), the wheel bundle, and the NVRTC compile check that
runs before device time is spent (README.md here)."""
