import os
import sys

# Tests import helpers such as `tolerances` and `dist_utils` as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
