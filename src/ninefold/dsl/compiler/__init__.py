"""Front end shared by the backends: the application's AST normalized, and tensor accesses analysed."""
