"""The bundle: the format both sides share (manifest, its files, the target table, typed errors)
and the pure helpers the build and the runtime both use. Imports nothing else of hexforge."""
