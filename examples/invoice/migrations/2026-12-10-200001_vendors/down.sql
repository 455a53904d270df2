DROP TABLE vendors;
