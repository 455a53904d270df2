DROP TABLE invoice_lines;
DROP TABLE invoices;
