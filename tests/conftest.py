import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                   # tests/helpers.py
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))  # the package, uninstalled
