from hsx.cli import app

if __name__ == "__main__":  # vLLM may start processes that re-import the main module
    app()
