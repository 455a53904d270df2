DROP TABLE calculation_results;
DROP TABLE feasibility_results;
DROP TABLE anfrage_extraktionen;
DROP TABLE dateien;
