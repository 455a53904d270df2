DROP TABLE ocr_pages;
