from hsx.cli import app

app()
