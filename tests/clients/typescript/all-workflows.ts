// What the test worker bundles: the test workflows and the example in examples/.
export * from './workflows';
export { embedDocument } from '../../../examples/embed_session';
// The package's own workflow, registered as a user registers it.
export { embedDatasetJob } from 'gpulane/workflow';
