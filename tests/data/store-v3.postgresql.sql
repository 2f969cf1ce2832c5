-- The store's schema at version 3 (before work leases and workers), as SQLAlchemy's
-- create_all wrote it for postgresql; the migration tests start from it.
CREATE TABLE akv_runs (
	id SERIAL NOT NULL, 
	name VARCHAR(200) NOT NULL, 
	config JSON NOT NULL, 
	seed INTEGER NOT NULL, 
	status VARCHAR(20) NOT NULL, 
	status_detail TEXT, 
	code_version VARCHAR(100) NOT NULL, 
	suite_version VARCHAR(100) NOT NULL, 
	created_at TIMESTAMP WITHOUT TIME ZONE NOT NULL, 
	updated_at TIMESTAMP WITHOUT TIME ZONE NOT NULL, 
	finished_at TIMESTAMP WITHOUT TIME ZONE, 
	PRIMARY KEY (id), 
	UNIQUE (name)
);
CREATE TABLE akv_schema_version (
	version SERIAL NOT NULL, 
	description VARCHAR(200) NOT NULL, 
	applied_at TIMESTAMP WITHOUT TIME ZONE NOT NULL, 
	PRIMARY KEY (version)
);
CREATE TABLE akv_policies (
	id SERIAL NOT NULL, 
	run_id INTEGER NOT NULL, 
	hash VARCHAR(64), 
	text TEXT, 
	raw_text TEXT, 
	name VARCHAR(100), 
	generation INTEGER NOT NULL, 
	proposer VARCHAR(40) NOT NULL, 
	status VARCHAR(20) NOT NULL, 
	structure_hash VARCHAR(64), 
	behaviour_hash VARCHAR(64), 
	duplicate_of INTEGER, 
	rejection_reason TEXT, 
	prompt TEXT, 
	response TEXT, 
	prompt_tokens INTEGER NOT NULL, 
	completion_tokens INTEGER NOT NULL, 
	proposal_cost_usd FLOAT NOT NULL, 
	meta JSON NOT NULL, 
	created_at TIMESTAMP WITHOUT TIME ZONE NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_policy_run_hash UNIQUE (run_id, hash), 
	FOREIGN KEY(run_id) REFERENCES akv_runs (id) ON DELETE CASCADE
);
CREATE INDEX ix_akv_policies_run_id ON akv_policies (run_id);
CREATE TABLE akv_validation_rounds (
	id SERIAL NOT NULL, 
	run_id INTEGER NOT NULL, 
	round INTEGER NOT NULL, 
	code_version VARCHAR(100) NOT NULL, 
	suite_version VARCHAR(100) NOT NULL, 
	settings JSON NOT NULL, 
	created_at TIMESTAMP WITHOUT TIME ZONE NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_validation_round UNIQUE (run_id, round), 
	FOREIGN KEY(run_id) REFERENCES akv_runs (id) ON DELETE CASCADE
);
CREATE INDEX ix_akv_validation_rounds_run_id ON akv_validation_rounds (run_id);
CREATE TABLE akv_baselines (
	run_id INTEGER NOT NULL, 
	role VARCHAR(40) NOT NULL, 
	policy_id INTEGER NOT NULL, 
	PRIMARY KEY (run_id, role), 
	FOREIGN KEY(run_id) REFERENCES akv_runs (id) ON DELETE CASCADE, 
	FOREIGN KEY(policy_id) REFERENCES akv_policies (id) ON DELETE CASCADE
);
CREATE TABLE akv_evaluations (
	id SERIAL NOT NULL, 
	run_id INTEGER NOT NULL, 
	policy_id INTEGER NOT NULL, 
	task_id VARCHAR(200) NOT NULL, 
	split VARCHAR(40) NOT NULL, 
	status VARCHAR(40) NOT NULL, 
	score FLOAT NOT NULL, 
	cost_usd FLOAT NOT NULL, 
	n_requests INTEGER NOT NULL, 
	tokens JSON NOT NULL, 
	wall_s FLOAT NOT NULL, 
	error TEXT, 
	created_at TIMESTAMP WITHOUT TIME ZONE NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_eval_policy_task_split UNIQUE (policy_id, task_id, split), 
	FOREIGN KEY(run_id) REFERENCES akv_runs (id) ON DELETE CASCADE, 
	FOREIGN KEY(policy_id) REFERENCES akv_policies (id) ON DELETE CASCADE
);
CREATE INDEX ix_akv_evaluations_policy_id ON akv_evaluations (policy_id);
CREATE INDEX ix_akv_evaluations_run_id ON akv_evaluations (run_id);
CREATE TABLE akv_policy_parents (
	child_id INTEGER NOT NULL, 
	parent_id INTEGER NOT NULL, 
	rank INTEGER NOT NULL, 
	PRIMARY KEY (child_id, parent_id), 
	FOREIGN KEY(child_id) REFERENCES akv_policies (id) ON DELETE CASCADE, 
	FOREIGN KEY(parent_id) REFERENCES akv_policies (id) ON DELETE CASCADE
);
CREATE TABLE akv_validations (
	id SERIAL NOT NULL, 
	run_id INTEGER NOT NULL, 
	round INTEGER DEFAULT '1' NOT NULL, 
	policy_id INTEGER NOT NULL, 
	role VARCHAR(20) NOT NULL, 
	label VARCHAR(100) NOT NULL, 
	n_tasks INTEGER NOT NULL, 
	score_mean FLOAT NOT NULL, 
	cost_mean FLOAT NOT NULL, 
	stats JSON NOT NULL, 
	non_dominated BOOLEAN NOT NULL, 
	champion BOOLEAN NOT NULL, 
	verdict TEXT NOT NULL, 
	created_at TIMESTAMP WITHOUT TIME ZONE NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_validation_run_round_policy UNIQUE (run_id, round, policy_id), 
	FOREIGN KEY(run_id) REFERENCES akv_runs (id) ON DELETE CASCADE, 
	FOREIGN KEY(policy_id) REFERENCES akv_policies (id) ON DELETE CASCADE
);
CREATE INDEX ix_akv_validations_run_id ON akv_validations (run_id);
CREATE INDEX ix_akv_eval_run_split ON akv_evaluations (run_id, split);
