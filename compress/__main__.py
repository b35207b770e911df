"""python -m llmopt"""
from llmopt.cli.main import main

main()
