"""python -m llmopt"""
from .cli import main

main()
