# EC2 tier: playbooks/provision-aws.yml and inventories/aws against a moto_server the
# tests start on 127.0.0.1 (integration), then site.yml through the aws_ec2 inventory
# with podman containers standing in for the instances (e2e). See docs/aws.md.
.PHONY: aws-test aws-test-moto
TEST_TIERS += aws-test

# moto only, no containers (about 2 minutes)
aws-test-moto: venv
	$(PYTEST) -q -m integration tests/aws

# Two workers, one file each (--dist loadfile): the provisioning chain against one moto
# (test_provision.py, 4 min) and site.yml on the containers (test_site_e2e.py, 4 min) are
# independent, each with its own moto_server.
aws-test: deps
	$(PYTEST) -q -m "integration or e2e" tests/aws $(XDIST) $(if $(XDIST),--dist loadfile)
