"""Layout only: each module's `build()` creates its tab's widgets and returns them by name."""
