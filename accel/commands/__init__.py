"""The accel command line."""
