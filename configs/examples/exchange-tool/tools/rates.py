"""A tool of your own for the exchange-tool example: the model looks a rate up instead of knowing it.

>>> exchange_rate("usd"), exchange_rate("XYZ")
('0.92', 'unknown currency XYZ; known: CHF, GBP, JPY, USD')
"""

RATES = {"USD": "0.92", "GBP": "1.17", "CHF": "1.05", "JPY": "0.0061"}


def exchange_rate(currency: str) -> str:
    """The price of one unit of a currency in euros.

    Args:
        currency: The ISO code of the currency, such as USD.
    """
    code = currency.strip().upper()
    return RATES.get(code, f"unknown currency {code}; known: {', '.join(sorted(RATES))}")
