"""``python -m cvllm ...`` runs the same click commands as the ``cvllm`` script."""

from cvllm.cli import main

if __name__ == "__main__":
    main()
